"""Compile a :class:`StructuredOutput` into a validated llguidance grammar, once per text.

Every new grammar goes through three steps, none on the event loop or the engine thread:

1. a child process converts, validates, compiles and probes it (:mod:`.sandbox`): a grammar
   that crashes the compiler, outruns ``timeout_s``, or whose first token mask costs more
   than :data:`~inlinelm.structured.grammar.MASK_BUDGET_S` is refused with a
   :class:`~inlinelm.errors.RequestError` (a 400), and this process never runs it;
2. one of this process's grammar threads (``num_slots``, each with its own child) compiles
   the accepted grammar text again, on a stack larger than the child's;
3. it computes the first mask once on a copy, which warms the lexer states every request's
   matcher shares, so a request's first step on the engine thread is cheap.

Steps 1 to 3 for one grammar are :func:`~inlinelm.structured.grammar.compile_grammar`;
this module schedules them: the queue, the grammar threads and their children.

Results are cached by ``(kind, text)`` (:mod:`.cache`), refusals too (not timeouts, which
may be the machine's load): the same grammar never compiles twice, even when two requests
ask for it at the same moment (they wait for one compile). The cache keeps at most
``cache_size`` grammars and ``cache_bytes`` of their estimated memory (the child measures
each compiled grammar's heap), dropping the least recently used first.

A compile nobody waits for any more (every request that asked for it was cancelled or
disconnected) is dropped from the queue, or killed in its child when it already runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inlinelm.errors import EngineClosedError, RequestError
from inlinelm.structured.cache import (
    CacheEntry,
    CacheStats,
    GrammarCache,
    NotCached,
    Waiter,
    resolve,
    spec_key,
)
from inlinelm.structured.grammar import PARAM, CompiledGrammar, compile_grammar
from inlinelm.structured.sandbox import (
    PARENT_STACK_BYTES,
    Sandbox,
    SandboxCrashed,
    SandboxTimeout,
    TokenizerSource,
)
from inlinelm.structured.sandbox_main import KIND_NAMES
from inlinelm.structured.spec import StructuredOutput

__all__ = ["CacheStats", "CompiledGrammar", "GrammarCompiler"]

logger = logging.getLogger("inlinelm")


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
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._entries = GrammarCache(cache_size, cache_bytes)
        self._queue: deque[CacheEntry] = deque()
        self._threads: list[threading.Thread] = []
        self._sandboxes: set[Sandbox] = set()
        self._source: TokenizerSource | None = None
        self._tokenizer: Any = None
        self._closed = False

    # -- callers ---------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        """The cache's hits, misses, abandoned compiles and size (one object, updated)."""
        return self._entries.stats

    def submit(self, spec: StructuredOutput) -> concurrent.futures.Future[CompiledGrammar]:
        """A future of ``spec``'s compiled grammar, this caller's own: its exception is a
        ``RequestError(param="structured")`` for a refused grammar. Cancelling it stops
        waiting; when every caller of a compile has cancelled, the compile stops."""
        waiter: Waiter = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            entry = self._entries.lookup(spec_key(spec))
            if entry is None:
                entry = self._start(spec)
            outcome = entry.outcome
            if outcome is None:
                entry.waiters.add(waiter)
        if outcome is not None:
            resolve(waiter, outcome)
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
        waiters: list[Waiter] = []
        with self._lock:
            self._closed = True
            for entry in self._entries.in_flight():
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
            resolve(waiter, closed)

    # -- the queue -------------------------------------------------------------------------

    def _start(self, spec: StructuredOutput) -> CacheEntry:
        """A new entry, queued for a grammar thread (under the lock)."""
        entry = self._entries.add(spec)
        self._queue.append(entry)
        if len(self._threads) < self._num_slots:
            self._start_thread()
        self._wake.notify()
        return entry

    def _on_waiter_done(self, entry: CacheEntry, waiter: concurrent.futures.Future[Any]) -> None:
        if not waiter.cancelled():
            return
        with self._lock:
            entry.waiters.discard(waiter)
            if entry.waiters or entry.outcome is not None or entry.abandoned:
                return
            # NOTE: nobody waits: forget it (a later request compiles it again) and stop it.
            self._entries.abandon(entry)
            if entry in self._queue:
                self._queue.remove(entry)
            sandbox = entry.running_in
        if sandbox is not None:
            sandbox.kill()

    def _finish(self, entry: CacheEntry, outcome: CompiledGrammar | BaseException) -> None:
        """Hand ``outcome`` to the entry's waiters, and to the cache to keep."""
        with self._lock:
            waiters = self._entries.finish(entry, outcome)
        for waiter in waiters:
            resolve(waiter, outcome)

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

    def _next(self) -> CacheEntry | None:
        with self._lock:
            while not self._queue and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            return self._queue.popleft()

    def _run(self, entry: CacheEntry, slot: _Slot) -> None:
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
            outcome = NotCached(f"the grammar could not be compiled: {type(e).__name__}: {e}")
        self._finish(entry, outcome)

    def _compile_retrying(self, entry: CacheEntry, slot: _Slot) -> CompiledGrammar:
        """:func:`compile_grammar` in the slot's child, once more on a new child when the first
        had died before the job reached it (an idle child killed is not the grammar's doing)."""
        for attempt in (1, 2):
            sandbox = self._live_sandbox(slot)
            with self._lock:
                if entry.abandoned:
                    raise _Abandoned
                entry.running_in = sandbox
            try:
                return compile_grammar(entry.spec, sandbox, self._timeout_s, self._llg_tokenizer)
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
            raise NotCached(f"the grammar compiler could not start: {e}") from e
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

    def _failure(self, entry: CacheEntry, error: Exception) -> BaseException:
        """What a child that died or timed out means for ``entry``'s waiters."""
        what = KIND_NAMES[entry.spec.kind]
        if entry.abandoned:
            return NotCached("the compile was cancelled")
        if isinstance(error, SandboxTimeout):
            return NotCached(
                f"the {what} took longer than {self._timeout_s:g} s to compile "
                "(grammar_compile_timeout_s); simplify it"
            )
        logger.warning("a %s crashed the grammar compiler: %s", what, error)
        if not (isinstance(error, SandboxCrashed) and error.is_fault):
            # NOTE: killed from outside (the OOM killer, an operator) or a failure of our
            # own: say so, but do not hold it against the grammar for good.
            return NotCached(f"the grammar compiler process ended while compiling the {what}")
        return RequestError(
            f"invalid {what}: it crashed the grammar compiler (too deeply nested or too "
            "large); simplify it",
            param=PARAM,
        )

    def _source_once(self) -> TokenizerSource:
        with self._lock:
            source = self._source
        if source is None:
            try:
                source = self._tokenizer_source()
            except ValueError as e:
                raise RequestError(
                    f"structured output needs a fast tokenizer: {e}", param=PARAM
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
