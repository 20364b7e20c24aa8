"""The public async ``Engine``: starts the engine thread, admits requests, hands out streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from inlinelm.config import EngineConfig
from inlinelm.errors import (
    EngineClosedError,
    EngineDeadError,
    QueueTimeoutError,
    RequestError,
)
from inlinelm.progress import silence_iprogress_warning
from inlinelm.runtime.admission import admit_count, admit_tokens, check_limits
from inlinelm.runtime.bridge import (
    Heartbeat,
    LoopBridge,
    OutputDispatcher,
    fail_engine,
    fail_loops,
    post_outputs,
)
from inlinelm.runtime.core_handle import CoreHandle
from inlinelm.runtime.loader import LoadedEngine, load_engine
from inlinelm.runtime.metrics import (
    EngineMetrics,
    EngineStats,
    PrometheusCollector,
    engine_stats,
)
from inlinelm.runtime.outputs import RequestOutput
from inlinelm.runtime.prompt_source import Prompt, PromptSource, chat_size
from inlinelm.runtime.request_state import (
    ParentRequest,
    RequestState,
    engine_requests,
    make_states,
)
from inlinelm.runtime.stream import RequestStream, Submission
from inlinelm.runtime.sync import generate_all, run_sync
from inlinelm.runtime.workers import Workers
from inlinelm.sampling_params import OutputKind, SamplingParams
from inlinelm.structured.compiler import CacheStats, CompiledGrammar

logger = logging.getLogger("inlinelm")


class Engine:
    """An LLM engine living in this process: one engine thread, outputs on the callers' loops.

    ``Engine(model="default", **options)`` or ``Engine(EngineConfig(...))``. Construction does
    no heavy work; ``await engine.start()`` (or the first request) loads the model off the
    event loop. Use ``async with Engine(...) as engine`` or call ``aclose()``/``close()``.
    """

    def __init__(self, config: EngineConfig | None = None, /, **options: Any) -> None:
        base = config if config is not None else EngineConfig()
        self.config = base.with_options(**options) if options else base
        self.metrics = EngineMetrics()
        self._dispatcher = OutputDispatcher()
        self._loaded: LoadedEngine | None = None
        self._start_future: concurrent.futures.Future[LoadedEngine] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._handle = CoreHandle()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._heartbeat = Heartbeat(time.perf_counter())
        self._workers = Workers()

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and start the engine thread (idempotent); returns once warm."""
        # NOTE: shielded: a cancelled wait (an interrupted generate) must not cancel the
        # start every caller shares, or the load's result would be lost.
        await asyncio.shield(asyncio.wrap_future(self._begin_start()))

    def _begin_start(self) -> concurrent.futures.Future[LoadedEngine]:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if self._start_future is None:
                self._start_future = concurrent.futures.Future()
                silence_iprogress_warning()
                threading.Thread(target=self._load, name="inlinelm-loader", daemon=True).start()
            return self._start_future

    def _load(self) -> None:
        assert self._start_future is not None
        try:
            # NOTE: the sink must not reference the Engine, so an Engine dropped without
            # close() is collected, and its finalizer stops the engine thread.
            loaded = load_engine(
                self.config, functools.partial(post_outputs, self._dispatcher, self._heartbeat)
            )
        except BaseException as e:
            self._start_future.set_exception(e)
            return
        self._finalizer = weakref.finalize(self, _shutdown, loaded)
        self._finalizer.atexit = False
        self._handle.core = loaded.core
        self._loaded = loaded
        self._start_future.set_result(loaded)

    def start_sync(self) -> None:
        """Blocking ``start()`` for scripts and threads."""
        self._begin_start().result()

    async def aclose(self) -> None:
        """Stop the engine thread, fail open streams with ``EngineClosedError``, free memory."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Blocking ``aclose()`` (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            future = self._start_future
        if future is not None:
            try:
                loaded = future.result()
            except BaseException:
                loaded = None
            if loaded is not None:
                loaded.core.shutdown()
                loaded.core.join()
                loaded.grammars.close()
        self._fail_all_loops(EngineClosedError("the engine was closed"))
        self._workers.close()
        # NOTE: drop every path to the core (and so to the runner's weights and KV cache).
        self._handle.core = None
        self._start_future = None
        if self._finalizer is not None:
            self._finalizer.detach()
        self._loaded = None
        gc.collect()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- state ---------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """True once the model is loaded and warm and the engine thread runs."""
        return self._loaded is not None and not self._closed

    def health(self, *, detail: bool = True) -> tuple[bool, str]:
        """``(True, "ok")``, or ``(False, reason)`` when closed, dead or stuck in a step.

        A death's reason names the error's class and, with ``detail``, its message (which
        may hold internals: an HTTP server shows clients the class only).
        """
        if self._closed:
            return False, "closed"
        error = self._dispatcher.fatal_error
        if error is not None:
            cause = type(error).__name__
            return False, f"dead: {cause}: {error}" if detail else f"dead: {cause}"
        loaded = self._loaded
        if loaded is None:
            return False, "starting"
        # NOTE: busy is judged by the requests callers wait for, not by the core's stats,
        # which are published after each step and so miss a first step that never ends.
        busy = any(bridge.processor.parents for bridge in self._dispatcher.bridges())
        idle_for = time.perf_counter() - self._heartbeat.last
        if busy and idle_for > self.config.step_timeout_s:
            return False, f"stuck: no engine step finished for {idle_for:.1f} s"
        return True, "ok"

    def __repr__(self) -> str:
        """What the engine serves and its state, e.g. ``<Engine model='default' on cpu:
        ready, 2 running, 0 waiting, KV blocks 40/8192 used>``."""
        config = self.config
        served = f"model={config.model!r}"
        if config.runner != "model":
            served += f" runner={config.runner!r}"
        ok, reason = self.health(detail=False)
        if self._start_future is None and not self._closed:
            state = "not started"
        elif ok or reason.startswith("stuck"):
            stats = self.stats()
            state = (
                f"{'ready' if ok else reason}, {stats['num_running']} running, "
                f"{stats['num_waiting']} waiting, "
                f"KV blocks {stats['kv_blocks_used']}/{stats['kv_blocks_total']} used"
            )
        else:
            state = reason
        return f"<Engine {served} on {config.device}: {state}>"

    @property
    def healthy(self) -> bool:
        """False when the engine is closed, dead or stuck."""
        return self.health()[0]

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer); available once started."""
        return self._require_loaded().tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the engine serves."""
        return self._require_loaded().max_model_len

    @property
    def model_name(self) -> str:
        """The served model id."""
        return (
            "default"
            if self.config.model == "default"
            else self.config.model.rstrip("/").split("/")[-1]
        )

    @property
    def num_kv_blocks(self) -> int:
        """Size of the KV block pool."""
        return self._require_loaded().core.num_kv_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        """Free KV blocks after the last engine step."""
        return self._require_loaded().core.num_free_blocks

    def stats(self) -> EngineStats:
        """Engine-wide numbers: queues, KV use, prefix-cache hit rate, histograms, coalescing,
        and the grammar cache (hits, misses, compiles abandoned by their clients, entries and
        their estimated bytes). A dict, which a notebook shows as a short table."""
        loaded = self._loaded
        stats = engine_stats(
            loaded.core.stats if loaded is not None else None,
            self.metrics,
            num_queued=self._handle.num_queued_requests,
            num_coalesced_steps=sum(b.num_coalesced_steps for b in self._dispatcher.bridges()),
        )
        cache = loaded.grammars.stats if loaded is not None else CacheStats()
        stats["grammar_cache_hits"] = cache.hits
        stats["grammar_cache_misses"] = cache.misses
        stats["grammar_compiles_abandoned"] = cache.abandoned
        stats["grammar_cache_entries"] = cache.num_entries
        stats["grammar_cache_bytes"] = cache.num_bytes
        return stats

    def register_metrics(self, registry: Any) -> None:
        """Register a Prometheus collector for this engine on ``registry``."""
        registry.register(PrometheusCollector(self.stats, self.metrics))

    # -- requests ------------------------------------------------------------------------

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        input_size: int = 0,
        **overrides: Any,
    ) -> RequestStream:
        """Start generating for ``prompt`` (text or token ids) and return its stream.

        ``params`` (default: ``SamplingParams()``) with keyword ``overrides`` applied
        (``engine.stream(prompt, max_tokens=64, temperature=0)``). Sampling fields the
        caller leaves unset take the engine's defaults at submit: the model's
        generation_config.json and the ``default_*`` options (see
        :meth:`default_sampling_params`); an unset ``max_tokens`` is ``default_max_tokens``
        when set, else the model's, else 16 (vLLM's and OpenAI's completions default; a chat's
        is 1024), never the whole context.

        When the engine is started, validation, admission and the hand-over to the engine
        happen here, so ``RequestError``/``QueueFullError``/``EngineError`` raise at once;
        before that they raise from the first ``async for``/``await``.

        A prompt longer than ``max_inline_prompt_chars`` (characters, or token ids) is
        tokenized and checked on a worker thread, off the event loop. ``input_size`` says
        the prompt belongs to a larger input (a server passes its request body's size, for
        a request of many prompts): the rule then judges that size.
        """
        size = len(prompt) if isinstance(prompt, (str, list)) else 0
        source = PromptSource(lambda: prompt, add_special_tokens, "prompt", max(size, input_size))
        return self._open(source, _params(params, overrides), request_id, arrival_time)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        input_size: int = 0,
        **overrides: Any,
    ) -> RequestStream:
        """Like :meth:`stream`, with the model's chat template applied to ``messages``
        (and to ``tools``, OpenAI-style function tools, when given). The messages' and the
        tools' text together decide whether the template runs off the event loop."""
        size = chat_size(messages, tools, limit=self.config.max_inline_prompt_chars)
        source = PromptSource(
            lambda: self.render_chat(messages, tools), False, "messages", max(size, input_size)
        )
        return self._open(source, _params(params, overrides), request_id, arrival_time)

    def _open(
        self,
        source: PromptSource,
        params: SamplingParams,
        request_id: str | None,
        arrival_time: float | None,
    ) -> RequestStream:
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:16]}"
        if not isinstance(rid, str) or not rid:
            raise RequestError("request_id must be a non-empty string", param="request_id")
        self._check_usable()
        check_limits(self.config, params)
        params = params.copy()  # NOTE: owned from here: the caller may still mutate its own
        stream = RequestStream(
            rid,
            lambda: self._submit_lazily(source, params, rid, arrival),
            delta=params.output_kind is OutputKind.DELTA,
        )
        # NOTE: a request with a grammar always takes the lazy path: its grammar compiles
        # on a worker thread, and a bad one raises from ``await stream.submit()``.
        inline = source.size <= self.config.max_inline_prompt_chars and params.structured is None
        if self.is_ready and inline:
            loaded = self._require_loaded()
            prompt_ids = self._tokenize(loaded, source)
            stream._attach(self._submit(loaded, prompt_ids, params, rid, arrival, source))
        return stream

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text the chat template makes of ``messages`` (with the assistant turn
        opened), and of ``tools`` when given (``apply_chat_template(..., tools=...)``)."""
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as e:
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from e
        return str(text)

    def default_sampling_params(self, *, chat: bool = False) -> SamplingParams:
        """The values this engine gives a completion's (``chat=True``: a chat's) unset
        sampling fields (max_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty): the ``default_*`` options when set, else the model's
        generation_config.json, else ``FALLBACK_SAMPLING`` (whose max_tokens is a chat's;
        a completion's is ``FALLBACK_COMPLETION_MAX_TOKENS``, 16). An unset ``max_tokens``
        is also cut to the room the prompt leaves in the context. Available once started."""
        return SamplingParams(**self._require_loaded().admission.defaults(chat=chat))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        **overrides: Any,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them and wait: the sync :meth:`stream`.

        ``prompts`` is a string, token ids, or a list of either; ``params`` and keyword
        ``overrides`` work as in :meth:`stream` (unset fields take the engine's defaults,
        see :meth:`default_sampling_params`). Returns one final ``RequestOutput`` per
        prompt, in order. ``use_tqdm`` shows a progress bar on a terminal or in Jupyter.

        Works from a plain script, any thread, and inside a running event loop (a Jupyter
        cell): it then runs on a private loop in a helper thread. In async code use
        :meth:`stream` instead.
        """
        batch: list[Prompt] = (
            [prompts]  # type: ignore[list-item]  # one prompt: text or token ids
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]  # a list of prompts
        )
        request_params = _params(params, overrides)
        return run_sync(
            generate_all(
                self.start, batch, lambda prompt: self.stream(prompt, request_params), use_tqdm
            )
        )

    def generate_chat(
        self,
        conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        **overrides: Any,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them and wait: the sync :meth:`chat`
        (vLLM's ``LLM.chat``).

        A conversation is a list of ``{"role": ..., "content": ...}`` messages; the model's
        chat template is applied and the assistant turn opened. ``params`` and keyword
        ``overrides`` work as in :meth:`stream`. Returns one final ``RequestOutput`` per
        conversation, in order; runs from scripts, threads and Jupyter cells like
        :meth:`generate`.
        """
        batch: list[Sequence[dict[str, Any]]] = (
            [conversations]  # type: ignore[list-item]  # one conversation: messages
            if conversations and isinstance(conversations[0], dict)
            else list(conversations)  # type: ignore[arg-type]  # a list of conversations
        )
        request_params = _params(params, overrides)
        return run_sync(
            generate_all(
                self.start, batch, lambda messages: self.chat(messages, request_params), use_tqdm
            )
        )

    # -- submission (event loop)
    # -----------------------------------------------------------

    async def _submit_lazily(
        self, source: PromptSource, params: SamplingParams, rid: str, arrival: float
    ) -> Submission:
        await self.start()
        loaded = self._require_loaded()
        if source.size <= self.config.max_inline_prompt_chars:
            prompt_ids = self._tokenize(loaded, source)
        else:
            # NOTE: invariant 12: a large prompt or chat is rendered and tokenized on a worker
            # thread (the tokenizer releases the GIL), so other streams keep flowing.
            prompt_ids = await self._workers.tokenize(self._tokenize, loaded, source)
        grammar = None
        if params.structured is not None:
            # NOTE: invariant 12: compiled (or fetched from the cache) in a child process and
            # on a grammar thread before anything is queued: a bad grammar is a RequestError
            # here, and the engine thread only ever sees a probed one. A cancelled wait (the
            # client left) stops the compile when nobody else waits for it.
            grammar = await asyncio.wrap_future(loaded.grammars.submit(params.structured))
        return self._submit(loaded, prompt_ids, params, rid, arrival, source, grammar)

    def _tokenize(self, loaded: LoadedEngine, source: PromptSource) -> list[int]:
        admit_count(self.config, self._handle)  # NOTE: a full queue refuses before tokenizing
        return self._encode(loaded, source)

    def _encode(self, loaded: LoadedEngine, source: PromptSource) -> list[int]:
        prompt = source.make()
        return loaded.admission.tokenize(prompt, source.add_special_tokens, source.param)

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """The token ids of ``prompt``, or of ``messages`` through the chat template (by
        default as :meth:`stream` and :meth:`chat` would send them: special tokens added to
        a prompt, not to a rendered chat). Large inputs are tokenized off the event loop;
        untokenizable text raises ``RequestError``."""
        await self.start()
        loaded = self._require_loaded()
        if messages is not None:
            special = bool(add_special_tokens)
            size = chat_size(messages, limit=self.config.max_inline_prompt_chars)
            source = PromptSource(lambda: self.render_chat(messages), special, "messages", size)
        elif isinstance(prompt, str):
            special = add_special_tokens is None or add_special_tokens
            source = PromptSource(lambda: prompt, special, "prompt", len(prompt))
        else:
            raise RequestError("give a prompt string or messages", param="prompt")
        if source.size <= self.config.max_inline_prompt_chars:
            return self._encode(loaded, source)
        return await self._workers.tokenize(self._encode, loaded, source)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (``tokenizer.decode``, special tokens kept); decoded on
        a worker thread when there are more than ``max_inline_prompt_chars // 4``."""
        (text,) = await self.detokenize_all([token_ids])
        return text

    async def detokenize_all(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """:meth:`detokenize` for several token-id lists at once: off the event loop when
        they hold more than ``max_inline_prompt_chars // 4`` ids together."""
        await self.start()
        tokenizer = self._require_loaded().tokenizer
        lists = [list(ids) for ids in prompts]
        if sum(map(len, lists)) <= self.config.max_inline_prompt_chars // 4:
            return [str(tokenizer.decode(ids)) for ids in lists]
        return await self._workers.tokenize(decode_all, tokenizer, lists)

    def _submit(
        self,
        loaded: LoadedEngine,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str,
        arrival: float,
        source: PromptSource,
        grammar: CompiledGrammar | None = None,
    ) -> Submission:
        """Admit a tokenized request and hand it to the engine thread (on the caller's loop);
        with ``grammar``, each choice gets its own matcher."""
        self._check_usable()
        admit_count(self.config, self._handle)
        params = loaded.admission.with_defaults(params, len(prompt_ids), chat=source.is_chat)
        loaded.admission.check_lengths(prompt_ids, params, source.param)
        admit_tokens(self.config, self._handle, len(prompt_ids))
        loop = asyncio.get_running_loop()
        bridge = self._loop_bridge(loop)
        parent, children = self._make_states(loaded, rid, prompt_ids, params, arrival)
        self._handle.claim(
            parent
        )  # NOTE: a duplicate id in flight raises before anything is queued
        self._handle.enqueue(parent)
        bridge.processor.add(parent, children)
        if self._dispatcher.fatal_error is not None or self._closed:
            bridge.drop(parent)
            self._check_usable()
        self._arm_queue_timeout(loop, bridge, parent)
        share = self.config.enable_prefix_caching
        requests = engine_requests(
            parent, children, loaded.eos_token_id, arrival, share_prefix=share
        )
        if grammar is not None:
            for request in (*requests, *parent.deferred):
                request.grammar = grammar.new_matcher()
        for request in requests:
            loaded.core.add_request(request)
        self._heartbeat.last = time.perf_counter()
        return Submission(parent, bridge)

    def _loop_bridge(self, loop: asyncio.AbstractEventLoop) -> LoopBridge:
        """This loop's bridge (and output handler task), created on first use."""
        on_failure = functools.partial(fail_engine, self._dispatcher, self._handle)
        return self._dispatcher.bridge_for(
            loop, lambda: LoopBridge(loop, self._handle, self.metrics, on_failure)
        )

    def _make_states(
        self,
        loaded: LoadedEngine,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
    ) -> tuple[ParentRequest, list[RequestState]]:
        return make_states(
            rid,
            self._handle.next_submission(),
            prompt_ids,
            params,
            arrival,
            functools.partial(loaded.make_detokenizer, prompt_ids, params),
            max_backlog_bytes=self.config.max_stream_backlog_bytes,
            stream_interval=params.stream_interval or self.config.stream_interval,
        )

    def _arm_queue_timeout(
        self, loop: asyncio.AbstractEventLoop, bridge: LoopBridge, parent: ParentRequest
    ) -> None:
        wait = self.config.max_queue_wait_s
        if wait is not None:
            parent.timeout = loop.call_later(wait, self._queue_timeout, bridge, parent)

    def _queue_timeout(self, bridge: LoopBridge, parent: ParentRequest) -> None:
        if parent.queued and bridge.processor.parents.get(parent.request_id) is parent:
            bridge.drop(parent)
            parent.collector.put(
                QueueTimeoutError(
                    f"request {parent.request_id} waited over max_queue_wait_s={self.config.max_queue_wait_s} s"
                )
            )

    def _fail_all_loops(self, error: BaseException) -> None:
        fail_loops(self._dispatcher, error)
        for bridge in self._dispatcher.bridges():
            with contextlib.suppress(RuntimeError):
                bridge.loop.call_soon_threadsafe(bridge.task.cancel)

    def _require_loaded(self) -> LoadedEngine:
        self._check_usable()
        if self._loaded is None:
            raise RuntimeError("the engine is not started yet: await engine.start() first")
        return self._loaded

    def _check_usable(self) -> None:
        error = self._dispatcher.fatal_error
        if error is not None:
            raise EngineDeadError(f"the engine failed: {error!r}") from error
        if self._closed:
            raise EngineClosedError("the engine is closed")


def decode_all(tokenizer: Any, lists: list[list[int]]) -> list[str]:
    """``[tokenizer.decode(ids) for ids in lists]``, with the GIL released while it runs
    when the tokenizer is a fast one (the Rust batch decode; transformers' own decode holds
    the GIL for the whole call, which stalls the event loop however many threads there are)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        # NOTE: transformers' space cleanup (its rules vary by version) follows the Rust
        # decode only through its own decode.
        return [str(tokenizer.decode(ids)) for ids in lists]
    texts: list[str] = backend.decode_batch(lists, skip_special_tokens=False)
    return texts


def _shutdown(loaded: LoadedEngine) -> None:
    """What an Engine dropped without close() stops: the engine thread and the grammar
    compiler's threads and child processes."""
    loaded.core.shutdown()
    loaded.grammars.close()


def _params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    base = params if params is not None else SamplingParams()
    return base.with_overrides(**overrides) if overrides else base
