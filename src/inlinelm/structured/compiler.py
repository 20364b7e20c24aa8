"""Compile a :class:`StructuredOutput` into a validated llguidance grammar, once per text.

Every new grammar goes through three steps, none on the event loop or the engine thread:

1. a child process converts, validates, compiles and probes it (:mod:`.sandbox`): a grammar
   that crashes the compiler, outruns ``timeout_s``, or whose first token mask costs more
   than ``MASK_BUDGET_S`` is refused with a :class:`~inlinelm.errors.RequestError` (a 400),
   and this process never runs it;
2. one of this process's grammar threads (``num_slots``, each with its own child) compiles
   the accepted grammar text again, on a stack larger than the child's;
3. it computes the first mask once on a copy, which warms the lexer states every request's
   matcher shares, so a request's first step on the engine thread is cheap.

Results are cached by ``(kind, text)``, refusals too (not timeouts, which may be the
machine's load): the same grammar never compiles twice, even when two requests ask for
it at the same moment (they wait for one compile). The cache keeps at most
``cache_size`` grammars and ``cache_bytes`` of their estimated memory (the child measures
each compiled grammar's heap), dropping the least recently used first.

A compile nobody waits for any more (every request that asked for it was cancelled or
disconnected) is dropped from the queue, or killed in its child when it already runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inlinelm.errors import EngineClosedError, RequestError
from inlinelm.structured.matcher import GrammarMatcher
from inlinelm.structured.sandbox import (
    PARENT_STACK_BYTES,
    Sandbox,
    SandboxCrashed,
    SandboxTimeout,
    TokenizerSource,
)
from inlinelm.structured.sandbox_main import KIND_NAMES
from inlinelm.structured.spec import StructuredOutput

logger = logging.getLogger("inlinelm")

_PARAM = "structured"

MASK_BUDGET_S = 0.2
"""CPU seconds a grammar's first token mask may take in the child's probe. Masks run on
the engine thread, where every running request waits for them; a first mask past this is
refused (``((a{100}){100}){100}`` takes 1.5 s). Typical grammars take 0.1 to 40 ms."""

_Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar llguidance accepted for this tokenizer, and a matcher template to copy.

    ``num_bytes`` is the compiled grammar's estimated memory (what the cache counts).
    """

    grammar: str
    template: Any  # llguidance.LLMatcher at its start state, never advanced
    vocab_size: int
    num_bytes: int = 0

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (one per choice)."""
        return GrammarMatcher(self.template.deep_copy(), self.vocab_size)


@dataclass(slots=True)
class CacheStats:
    """Requests served from the cache or from a compile in flight (hits), compiles
    started (misses), compiles dropped because nobody waited (abandoned), and the cache's
    size now."""

    hits: int = 0
    misses: int = 0
    abandoned: int = 0
    num_entries: int = 0
    num_bytes: int = 0


@dataclass(eq=False, slots=True)
class _Entry:
    """One grammar: compiling (``waiters`` wait for it) or done (``outcome`` set)."""

    key: _Key
    spec: StructuredOutput
    waiters: set[concurrent.futures.Future[CompiledGrammar]] = field(default_factory=set)
    outcome: CompiledGrammar | BaseException | None = None
    num_bytes: int = 0
    running_in: Sandbox | None = None
    abandoned: bool = False


class GrammarCompiler:
    """Turns ``StructuredOutput`` into :class:`CompiledGrammar` (see the module docstring).

    ``tokenizer`` gives the :class:`TokenizerSource`, called on the first compile (so an
    engine that never sees a grammar never builds one); a ``ValueError`` from it (a slow
    tokenizer) refuses structured output. Thread-safe; :meth:`close` stops the threads
    and the children.
    """

    def __init__(
        self,
        tokenizer: Callable[[], TokenizerSource],
        *,
        num_slots: int = 2,
        timeout_s: float = 10.0,
        cache_size: int = 256,
        cache_bytes: int = 512 * 1024**2,
    ) -> None:
        self._tokenizer_source = tokenizer
        self._num_slots = num_slots
        self._timeout_s = timeout_s
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._queue: deque[_Entry] = deque()
        self._threads: list[threading.Thread] = []
        self._sandboxes: set[Sandbox] = set()
        self._source: TokenizerSource | None = None
        self._tokenizer: Any = None
        self._closed = False
        self.stats = CacheStats()

    # -- callers ---------------------------------------------------------------------------

    def submit(self, spec: StructuredOutput) -> concurrent.futures.Future[CompiledGrammar]:
        """A future of ``spec``'s compiled grammar, this caller's own: its exception is a
        ``RequestError(param="structured")`` for a refused grammar. Cancelling it stops
        waiting; when every caller of a compile has cancelled, the compile stops."""
        waiter: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            entry = self._entries.get(spec_key(spec))
            if entry is None:
                entry = self._start(spec)
            else:
                self.stats.hits += 1
                self._entries.move_to_end(entry.key)
            outcome = entry.outcome
            if outcome is None:
                entry.waiters.add(waiter)
        if outcome is not None:
            _resolve(waiter, outcome)
        else:
            waiter.add_done_callback(lambda w: self._on_waiter_done(entry, w))
        return waiter

    @property
    def child_pids(self) -> list[int]:
        """The process ids of the compiler's live child processes (for monitoring)."""
        with self._lock:
            return [s.pid for s in self._sandboxes if s.alive]

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Blocking :meth:`submit`: the compiled grammar, or its ``RequestError``."""
        return self.submit(spec).result()

    def close(self) -> None:
        """Stop the grammar threads and kill the children; compiles still waited for fail
        with ``EngineClosedError``. Idempotent."""
        waiters: list[concurrent.futures.Future[CompiledGrammar]] = []
        with self._lock:
            self._closed = True
            for entry in self._entries.values():
                if entry.outcome is None:
                    entry.abandoned = True
                    waiters.extend(entry.waiters)
                    entry.waiters = set()
            sandboxes, threads = list(self._sandboxes), self._threads
            self._queue.clear()
            self._wake.notify_all()
        for sandbox in sandboxes:
            sandbox.kill()
        for thread in threads:
            if thread is not threading.current_thread():  # NOTE: a finalizer may run on one
                thread.join()
        closed = EngineClosedError("the engine was closed")
        for waiter in waiters:
            _resolve(waiter, closed)

    # -- the cache -------------------------------------------------------------------------

    def _start(self, spec: StructuredOutput) -> _Entry:
        """A new entry, queued for a grammar thread (under the lock)."""
        self.stats.misses += 1
        entry = _Entry(spec_key(spec), spec)
        self._entries[entry.key] = entry
        self._queue.append(entry)
        if len(self._threads) < self._num_slots:
            self._start_thread()
        self._wake.notify()
        return entry

    def _on_waiter_done(self, entry: _Entry, waiter: concurrent.futures.Future[Any]) -> None:
        if not waiter.cancelled():
            return
        with self._lock:
            entry.waiters.discard(waiter)
            if entry.waiters or entry.outcome is not None or entry.abandoned:
                return
            # NOTE: nobody waits: forget it (a later request compiles it again) and stop it.
            entry.abandoned = True
            self.stats.abandoned += 1
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            if entry in self._queue:
                self._queue.remove(entry)
            sandbox = entry.running_in
        if sandbox is not None:
            sandbox.kill()

    def _finish(self, entry: _Entry, outcome: CompiledGrammar | BaseException) -> None:
        """Hand ``outcome`` to the entry's waiters and keep it in the cache (unless it was
        abandoned or timed out), then evict what is over the budgets."""
        with self._lock:
            entry.running_in = None
            entry.outcome = outcome
            waiters, entry.waiters = entry.waiters, set()
            entry.num_bytes = _size_of(outcome)
            # NOTE: a grammar bigger than the whole budget would evict every other one.
            keep = (
                not entry.abandoned
                and not isinstance(outcome, _NotCached)
                and entry.num_bytes <= self._cache_bytes
            )
            if keep and self._entries.get(entry.key) is entry:
                self.stats.num_entries += 1
                self.stats.num_bytes += entry.num_bytes
                self._evict()
            elif self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
        for waiter in waiters:
            _resolve(waiter, outcome)

    def _evict(self) -> None:
        """Drop the least recently used done entries past the count or byte budget."""
        stats = self.stats
        for key in list(self._entries):
            if stats.num_entries <= self._cache_size and stats.num_bytes <= self._cache_bytes:
                return
            entry = self._entries[key]
            if entry.outcome is None:
                continue  # NOTE: in flight: its waiters hold it, and it is not counted yet
            del self._entries[key]
            stats.num_entries -= 1
            stats.num_bytes -= entry.num_bytes

    # -- grammar threads -------------------------------------------------------------------

    def _start_thread(self) -> None:
        """One more grammar thread, with ``PARENT_STACK_BYTES`` of stack (under the lock)."""
        # NOTE: threading.stack_size applies to threads started after it, process-wide;
        # set it for this start only.
        previous = threading.stack_size(PARENT_STACK_BYTES)
        try:
            thread = threading.Thread(
                target=self._serve, name=f"inlinelm-grammar-{len(self._threads)}", daemon=True
            )
            thread.start()
        finally:
            threading.stack_size(previous)
        self._threads.append(thread)

    def _serve(self) -> None:
        """A grammar thread: take queued entries until closed, each through this thread's
        child (started when first needed, and again after it dies)."""
        slot = _Slot()
        try:
            while (entry := self._next()) is not None:
                self._run(entry, slot)
        finally:
            if slot.sandbox is not None:
                self._forget(slot.sandbox)

    def _next(self) -> _Entry | None:
        with self._lock:
            while not self._queue and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            return self._queue.popleft()

    def _run(self, entry: _Entry, slot: _Slot) -> None:
        """Compile ``entry`` and hand out the outcome."""
        try:
            outcome: CompiledGrammar | BaseException = self._compile_retrying(entry, slot)
        except (SandboxCrashed, SandboxTimeout) as e:
            outcome = self._failure(entry, e)
        except _Abandoned:
            return
        except RequestError as e:
            outcome = e
        except Exception as e:
            logger.exception("compiling a grammar failed")
            outcome = _NotCached(f"the grammar could not be compiled: {type(e).__name__}: {e}")
        self._finish(entry, outcome)

    def _compile_retrying(self, entry: _Entry, slot: _Slot) -> CompiledGrammar:
        """:meth:`_compile` in the slot's child, once more on a new child when the first
        had died before the job reached it (an idle child killed is not the grammar's doing)."""
        for attempt in (1, 2):
            sandbox = self._live_sandbox(slot)
            with self._lock:
                if entry.abandoned:
                    raise _Abandoned
                entry.running_in = sandbox
            try:
                return self._compile(entry.spec, sandbox)
            except SandboxCrashed as e:
                if not e.before_job or entry.abandoned or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _live_sandbox(self, slot: _Slot) -> Sandbox:
        """The slot's child when it lives, else a new one (its start is not timed)."""
        if slot.sandbox is not None and slot.sandbox.alive:
            return slot.sandbox
        if slot.sandbox is not None:
            self._forget(slot.sandbox)
            slot.sandbox = None
        source = self._source_once()
        try:
            new = Sandbox(source)
        except (SandboxCrashed, SandboxTimeout, OSError) as e:
            logger.error("the grammar compiler process could not start: %s", e)
            raise _NotCached(f"the grammar compiler could not start: {e}") from e
        with self._lock:
            self._sandboxes.add(new)
            closed = self._closed
        if closed:
            new.kill()
        slot.sandbox = new
        return new

    def _forget(self, sandbox: Sandbox) -> None:
        sandbox.close()
        with self._lock:
            self._sandboxes.discard(sandbox)

    def _failure(self, entry: _Entry, error: Exception) -> BaseException:
        """What a child that died or timed out means for ``entry``'s waiters."""
        what = KIND_NAMES[entry.spec.kind]
        if entry.abandoned:
            return _NotCached("the compile was cancelled")
        if isinstance(error, SandboxTimeout):
            return _NotCached(
                f"the {what} took longer than {self._timeout_s:g} s to compile "
                "(grammar_compile_timeout_s); simplify it"
            )
        logger.warning("a %s crashed the grammar compiler: %s", what, error)
        if not (isinstance(error, SandboxCrashed) and error.is_fault):
            # NOTE: killed from outside (the OOM killer, an operator) or a failure of our
            # own: say so, but do not hold it against the grammar for good.
            return _NotCached(f"the grammar compiler process ended while compiling the {what}")
        return RequestError(
            f"invalid {what}: it crashed the grammar compiler (too deeply nested or too "
            "large); simplify it",
            param=_PARAM,
        )

    def _compile(self, spec: StructuredOutput, sandbox: Sandbox) -> CompiledGrammar:
        """The child's verdict, then the compile here (steps 1 to 3 of the module docstring)."""
        import llguidance

        job = {"kind": spec.kind, "text": spec.text, "mask_budget_s": MASK_BUDGET_S}
        reply = sandbox.run(job, self._timeout_s)
        if not reply["ok"]:
            raise RequestError(reply["error"], param=_PARAM)
        tokenizer = self._llg_tokenizer()
        template = llguidance.LLMatcher(tokenizer, reply["grammar"], log_level=0)
        if template.is_error():
            message = f"invalid {KIND_NAMES[spec.kind]}: {template.get_error()}"
            raise RequestError(message, param=_PARAM)
        compiled = CompiledGrammar(
            reply["grammar"], template, tokenizer.vocab_size, int(reply["bytes"])
        )
        _warm(compiled)
        return compiled

    def _source_once(self) -> TokenizerSource:
        with self._lock:
            source = self._source
        if source is None:
            try:
                source = self._tokenizer_source()
            except ValueError as e:
                raise RequestError(
                    f"structured output needs a fast tokenizer: {e}", param=_PARAM
                ) from e
            with self._lock:
                self._source = source
        return source

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = self._source_once().build()
            with self._lock:
                self._tokenizer = self._tokenizer or tokenizer
                tokenizer = self._tokenizer
        return tokenizer


@dataclass(slots=True)
class _Slot:
    """One grammar thread's child process (None until needed, or after it died)."""

    sandbox: Sandbox | None = None


class _Abandoned(Exception):
    """Nobody waits for the entry any more: drop it without an outcome."""


class _NotCached(RequestError):
    """A refusal that says nothing about the grammar itself (a timeout, a cancelled or
    failed compile): handed to the waiters, never cached."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param=_PARAM)


def spec_key(spec: StructuredOutput) -> _Key:
    """The cache key of ``spec``."""
    return (spec.kind, spec.text)


def _size_of(outcome: CompiledGrammar | BaseException) -> int:
    if isinstance(outcome, CompiledGrammar):
        return outcome.num_bytes
    return len(str(outcome))


def _warm(compiled: CompiledGrammar) -> None:
    """Compute the first mask once, on a copy: its lexer states are shared by every copy."""
    import ctypes

    words = -(-compiled.vocab_size // 32)
    mask = (ctypes.c_uint32 * words)()
    compiled.template.deep_copy().unsafe_compute_mask_ptr(ctypes.addressof(mask), words * 4)


def _resolve(
    waiter: concurrent.futures.Future[CompiledGrammar], outcome: CompiledGrammar | BaseException
) -> None:
    """Set ``waiter``'s outcome unless its caller already cancelled it."""
    try:
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # NOTE: cancelled meanwhile: nobody reads it
