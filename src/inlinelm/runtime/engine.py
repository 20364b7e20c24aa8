"""The public async ``Engine``: starts the engine thread, admits requests, hands out streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from inlinelm.config import EngineConfig
from inlinelm.errors import EngineClosedError, RequestError
from inlinelm.progress import silence_iprogress_warning
from inlinelm.runtime.bridge import (
    CoreHandle,
    Heartbeat,
    OutputDispatcher,
    close_loops,
    engine_health,
    post_outputs,
)
from inlinelm.runtime.loader import LoadedEngine, load_engine
from inlinelm.runtime.metrics import (
    EngineMetrics,
    EngineStats,
    PrometheusCollector,
    engine_stats,
)
from inlinelm.runtime.outputs import RequestOutput
from inlinelm.runtime.prompt_source import (
    Prompt,
    PromptSource,
    chat_size,
    conversation_batch,
    prompt_batch,
    render_chat,
)
from inlinelm.runtime.stream import RequestStream
from inlinelm.runtime.submission import Submitter
from inlinelm.runtime.sync import generate_all, run_sync
from inlinelm.runtime.workers import Workers
from inlinelm.sampling_params import SamplingParams
from inlinelm.structured.compiler import CacheStats

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
        self._start_future: concurrent.futures.Future[LoadedEngine] | None = None
        self._lock = threading.Lock()
        # NOTE: the handle holds the loaded parts and the closed flag: what the bridges,
        # timers and streams share with the Engine, without holding the Engine.
        self._handle = CoreHandle()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._heartbeat = Heartbeat(time.perf_counter())
        self._workers = Workers()
        self._submitter = Submitter(
            self.config,
            self._handle,
            self._dispatcher,
            self.metrics,
            self._heartbeat,
            self._workers,
            self.start,
        )

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and start the engine thread (idempotent); returns once warm."""
        # NOTE: shielded: a cancelled wait (an interrupted generate) must not cancel the
        # start every caller shares, or the load's result would be lost.
        await asyncio.shield(asyncio.wrap_future(self._begin_start()))

    def _begin_start(self) -> concurrent.futures.Future[LoadedEngine]:
        with self._lock:
            if self._handle.closed:
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
        self._handle.loaded = loaded
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
            if self._handle.closed:
                return
            self._handle.closed = True
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
        close_loops(self._dispatcher, EngineClosedError("the engine was closed"))
        self._workers.close()
        # NOTE: drop every path to the core (and so to the runner's weights and KV cache).
        self._handle.loaded = None
        self._start_future = None
        if self._finalizer is not None:
            self._finalizer.detach()
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
        return self._handle.loaded is not None and not self._handle.closed

    def health(self, *, detail: bool = True) -> tuple[bool, str]:
        """``(True, "ok")``, or ``(False, reason)`` when closed, dead or stuck in a step.

        A death's reason names the error's class and, with ``detail``, its message (which
        may hold internals: an HTTP server shows clients the class only).
        """
        return engine_health(
            self._handle, self._dispatcher, self._heartbeat, self.config.step_timeout_s, detail
        )

    def __repr__(self) -> str:
        """What the engine serves and its state, e.g. ``<Engine model='default' on cpu:
        ready, 2 running, 0 waiting, KV blocks 40/8192 used>``."""
        config = self.config
        served = f"model={config.model!r}"
        if config.runner != "model":
            served += f" runner={config.runner!r}"
        ok, reason = self.health(detail=False)
        if self._start_future is None and not self._handle.closed:
            state = "not started"
        elif ok or reason.startswith("stuck"):
            state = self.stats().summary("ready" if ok else reason)
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
        return self._submitter.require_loaded().tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the engine serves."""
        return self._submitter.require_loaded().max_model_len

    @property
    def model_name(self) -> str:
        """The served model id."""
        model = self.config.model
        return "default" if model == "default" else model.rstrip("/").split("/")[-1]

    @property
    def num_kv_blocks(self) -> int:
        """Size of the KV block pool."""
        return self._submitter.require_loaded().core.stats.num_kv_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        """Free KV blocks after the last engine step."""
        return self._submitter.require_loaded().core.stats.num_free_blocks

    def stats(self) -> EngineStats:
        """Engine-wide numbers: queues, KV use, prefix-cache hit rate, histograms, coalescing,
        and the grammar cache (hits, misses, compiles abandoned by their clients, entries and
        their estimated bytes). A dict, which a notebook shows as a short table."""
        loaded = self._handle.loaded
        return engine_stats(
            loaded.core.stats if loaded is not None else None,
            self.metrics,
            num_queued=self._handle.num_queued_requests,
            num_coalesced_steps=sum(b.num_coalesced_steps for b in self._dispatcher.bridges()),
            grammars=loaded.grammars.stats if loaded is not None else CacheStats(),
        )

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
        source = PromptSource.of_prompt(prompt, add_special_tokens, max(size, input_size))
        return self._submitter.open(source, _params(params, overrides), request_id, arrival_time)

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
        source = PromptSource.of_chat(messages, tools, max(size, input_size))
        return self._submitter.open(source, _params(params, overrides), request_id, arrival_time)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text the chat template makes of ``messages`` (with the assistant turn
        opened), and of ``tools`` when given (``apply_chat_template(..., tools=...)``)."""
        return render_chat(self.tokenizer, messages, tools)

    def default_sampling_params(self, *, chat: bool = False) -> SamplingParams:
        """The values this engine gives a completion's (``chat=True``: a chat's) unset
        sampling fields (max_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty): the ``default_*`` options when set, else the model's
        generation_config.json, else ``FALLBACK_SAMPLING`` (whose max_tokens is a chat's;
        a completion's is ``FALLBACK_COMPLETION_MAX_TOKENS``, 16). An unset ``max_tokens``
        is also cut to the room the prompt leaves in the context. Available once started."""
        return SamplingParams(**self._submitter.require_loaded().admission.defaults(chat=chat))

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
        request_params = _params(params, overrides)
        opened = functools.partial(self.stream, params=request_params)
        return run_sync(generate_all(self.start, prompt_batch(prompts), opened, use_tqdm))

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
        request_params = _params(params, overrides)
        opened = functools.partial(self.chat, params=request_params)
        return run_sync(
            generate_all(self.start, conversation_batch(conversations), opened, use_tqdm)
        )

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
        if messages is not None:
            size = chat_size(messages, limit=self.config.max_inline_prompt_chars)
            source = PromptSource.of_chat(messages, None, size, bool(add_special_tokens))
        elif isinstance(prompt, str):
            special = add_special_tokens is None or add_special_tokens
            source = PromptSource.of_prompt(prompt, special, len(prompt))
        else:
            raise RequestError("give a prompt string or messages", param="prompt")
        return await self._submitter.token_ids(source)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (``tokenizer.decode``, special tokens kept); decoded on
        a worker thread when there are more than ``max_inline_prompt_chars // 4``."""
        (text,) = await self.detokenize_all([token_ids])
        return text

    async def detokenize_all(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """:meth:`detokenize` for several token-id lists at once: off the event loop when
        they hold more than ``max_inline_prompt_chars // 4`` ids together."""
        return await self._submitter.texts([list(ids) for ids in prompts])


def _shutdown(loaded: LoadedEngine) -> None:
    """What an Engine dropped without close() stops: the engine thread and the grammar
    compiler's threads and child processes."""
    loaded.core.shutdown()
    loaded.grammars.close()


def _params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    base = params if params is not None else SamplingParams()
    return base.with_overrides(**overrides) if overrides else base
