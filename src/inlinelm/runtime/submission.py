"""The submission pipeline: a caller's prompt and params become a request in flight.

One path for every request (vLLM's ``Processor``): :meth:`Submitter.open` checks the
request against the engine's caps and returns its stream; the stream is submitted at once
when the engine is started and the prompt is small, else by the stream's first read
(:class:`LazySubmission`), which starts the engine, tokenizes a large prompt on a worker
thread and compiles a grammar first. :meth:`Submitter.submit` then admits the tokenized
request (queue limits, context length, the engine's sampling defaults), makes its
event-loop state and hands it to the engine thread through the :class:`CoreHandle`.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from inlinelm.config import EngineConfig
from inlinelm.errors import (
    EngineClosedError,
    EngineDeadError,
    QueueFullError,
    QueueTimeoutError,
    RequestError,
)
from inlinelm.reasoning import ReasoningParser
from inlinelm.runtime.admission import check_limits
from inlinelm.runtime.bridge import (
    CoreHandle,
    Heartbeat,
    LoopBridge,
    OutputDispatcher,
    fail_engine,
)
from inlinelm.runtime.loader import LoadedEngine
from inlinelm.runtime.metrics import EngineMetrics
from inlinelm.runtime.prompt_source import Prompt, PromptSource
from inlinelm.runtime.request_state import (
    ParentRequest,
    RequestState,
    engine_requests,
    make_states,
)
from inlinelm.runtime.stream import RequestStream, Submission
from inlinelm.runtime.workers import Workers, decode_all
from inlinelm.sampling_params import OutputKind, SamplingParams
from inlinelm.sched.pooling import Pooling
from inlinelm.structured.compiler import CompiledGrammar
from inlinelm.structured.matcher import ReasoningGate

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LazySubmission:
    """A request opened before it could be handed over: submitted by its stream's first read."""

    submitter: Submitter
    source: PromptSource
    params: SamplingParams
    request_id: str
    arrival: float
    # A chat's reasoning parser: None the engine's, "none" no split (a completion's)
    reasoning: ReasoningParser | str | None = "none"
    # A pooling request's pooling (Engine.embed, Engine.score); None: it generates
    pooling: Pooling | None = None

    async def submit(self) -> Submission:
        """Start the engine if needed, tokenize and admit the request, and hand it over."""
        return await self.submitter.submit_lazily(self)


class Submitter:
    """Checks, admits and hands over every request of one engine (event-loop side)."""

    def __init__(
        self,
        config: EngineConfig,
        handle: CoreHandle,
        dispatcher: OutputDispatcher,
        metrics: EngineMetrics,
        heartbeat: Heartbeat,
        workers: Workers,
        start: Callable[[], Awaitable[None]],
    ) -> None:
        self.config = config
        self._handle = handle
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._heartbeat = heartbeat
        self._workers = workers
        self._start = start

    # -- the engine's state, as a request sees it ------------------------------------------

    def check_usable(self) -> None:
        """``EngineDeadError`` once the engine failed, ``EngineClosedError`` once closed."""
        error = self._dispatcher.fatal_error
        if error is not None:
            raise EngineDeadError(f"the engine failed: {error!r}") from error
        if self._handle.closed:
            raise EngineClosedError("the engine is closed")

    def require_loaded(self) -> LoadedEngine:
        """The started engine's parts; raises when the engine is closed, dead or not started."""
        self.check_usable()
        loaded = self._handle.loaded
        if loaded is None:
            raise RuntimeError("the engine is not started yet: await engine.start() first")
        return loaded

    # -- opening a request ---------------------------------------------------------------

    def open(
        self,
        source: PromptSource,
        params: SamplingParams,
        request_id: str | None,
        arrival_time: float | None,
        reasoning: ReasoningParser | str | None = "none",
        pooling: Pooling | None = None,
    ) -> RequestStream:
        """The request's stream, submitted now when the engine is started and the prompt
        small enough to tokenize on the loop (and it has no grammar to compile);
        ``reasoning`` as :class:`LazySubmission` takes it."""
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:16]}"
        if not isinstance(rid, str) or not rid:
            raise RequestError("request_id must be a non-empty string", param="request_id")
        self.check_usable()
        check_limits(self.config, params)
        pending = LazySubmission(self, source, params, rid, arrival, reasoning, pooling)
        stream = RequestStream(rid, pending, delta=params.output_kind is OutputKind.DELTA)
        # NOTE: a request with a grammar always takes the lazy path: its grammar compiles
        # on a worker thread, and a bad one raises from ``await stream.submit()``.
        inline = source.size <= self.config.max_inline_prompt_chars and params.structured is None
        loaded = self._handle.loaded
        if loaded is not None and inline:
            prompt_ids = self.tokenize(loaded, source)
            stream._attach(self.submit(loaded, prompt_ids, pending))
        return stream

    async def submit_lazily(self, pending: LazySubmission) -> Submission:
        """:meth:`submit` for a request opened before the engine started, with a large
        prompt, or with a grammar: the slow parts run off the event loop first."""
        await self._start()
        loaded = self.require_loaded()
        source = pending.source
        if source.size <= self.config.max_inline_prompt_chars:
            prompt_ids = self.tokenize(loaded, source)
        else:
            # NOTE: invariant 12: a large prompt or chat is rendered and tokenized on a worker
            # thread (the tokenizer releases the GIL), so other streams keep flowing.
            prompt_ids = await self._workers.tokenize(self.tokenize, loaded, source)
        grammar = None
        if pending.params.structured is not None:
            # NOTE: invariant 12: compiled (or fetched from the cache) in a child process and
            # on a grammar thread before anything is queued: a bad grammar is a RequestError
            # here, and the engine thread only ever sees a probed one. A cancelled wait (the
            # client left) stops the compile when nobody else waits for it.
            grammar = await asyncio.wrap_future(loaded.grammars.submit(pending.params.structured))
        return self.submit(loaded, prompt_ids, pending, grammar)

    def tokenize(self, loaded: LoadedEngine, source: PromptSource) -> list[int]:
        """The prompt's token ids, once the queue has room for one more request."""
        admit_count(self.config, self._handle)  # NOTE: a full queue refuses before tokenizing
        return encode(loaded, source)

    async def token_ids(self, source: PromptSource) -> list[int]:
        """The token ids of ``source``, as a request would send them (``Engine.tokenize``):
        a large input is rendered and tokenized on a worker thread."""
        await self._start()
        loaded = self.require_loaded()
        if source.size <= self.config.max_inline_prompt_chars:
            return encode(loaded, source)
        return await self._workers.tokenize(encode, loaded, source)

    async def prepare(self, fn: Callable[[LoadedEngine], T], size: int) -> T:
        """``fn(loaded)`` once started: on the event loop for inputs of up to
        ``max_inline_prompt_chars`` (``size``), else on a tokenizer worker thread."""
        await self._start()
        loaded = self.require_loaded()
        if size <= self.config.max_inline_prompt_chars:
            return fn(loaded)
        return await self._workers.tokenize(fn, loaded)

    async def texts(self, lists: list[list[int]]) -> list[str]:
        """The text of each token-id list (``Engine.detokenize_all``): decoded on a worker
        thread past ``max_inline_prompt_chars // 4`` ids in all."""
        await self._start()
        tokenizer = self.require_loaded().tokenizer
        if sum(map(len, lists)) <= self.config.max_inline_prompt_chars // 4:
            return [str(tokenizer.decode(ids)) for ids in lists]
        return await self._workers.tokenize(decode_all, tokenizer, lists)

    # -- handing over --------------------------------------------------------------------

    def submit(
        self,
        loaded: LoadedEngine,
        prompt_ids: list[int],
        pending: LazySubmission,
        grammar: CompiledGrammar | None = None,
    ) -> Submission:
        """Admit a tokenized request and hand it to the engine thread (on the caller's loop);
        with ``grammar``, each choice gets its own matcher (behind a reasoning gate when
        the chat's reasoning parser says the model thinks first)."""
        self.check_usable()
        admit_count(self.config, self._handle)
        source = pending.source
        check_task(loaded, task_of(pending.pooling))
        params = loaded.admission.with_defaults(
            pending.params, len(prompt_ids), chat=source.is_chat
        )
        if pending.pooling is None:
            loaded.admission.check_lengths(prompt_ids, params, source.param)
        else:
            check_pooled_length(loaded, len(prompt_ids), source.param)
        admit_tokens(self.config, self._handle, len(prompt_ids))
        loop = asyncio.get_running_loop()
        bridge = self._loop_bridge(loop)
        reasoning = loaded.reasoning if pending.reasoning is None else pending.reasoning
        parser = None if isinstance(reasoning, str) else reasoning
        parent, children = self._make_states(loaded, pending, prompt_ids, params, parser)
        # NOTE: a duplicate id in flight raises before anything is queued.
        self._handle.claim(parent)
        self._handle.enqueue(parent)
        bridge.processor.add(parent, children)
        if self._dispatcher.fatal_error is not None or self._handle.closed:
            bridge.drop(parent)
            self.check_usable()
        self._arm_queue_timeout(loop, bridge, parent)
        share = self.config.enable_prefix_caching
        requests = engine_requests(
            parent, children, loaded.eos_token_id, pending.arrival, share_prefix=share
        )
        for request in requests:
            request.pooling = pending.pooling
        if grammar is not None:
            # NOTE: a reasoning model's grammar constrains only what follows its reasoning
            end_ids = loaded.reasoning_end_ids(parser, prompt_ids)
            for request in (*requests, *parent.deferred):
                if end_ids:
                    request.grammar_gate = ReasoningGate(grammar.new_matcher(), end_ids)
                else:
                    request.grammar = grammar.new_matcher()
        self._handle.add(requests)
        self._heartbeat.last = time.perf_counter()
        return Submission(parent, bridge)

    def _loop_bridge(self, loop: asyncio.AbstractEventLoop) -> LoopBridge:
        """This loop's bridge (and output handler task), created on first use."""
        on_failure = functools.partial(fail_engine, self._dispatcher, self._handle)
        return self._dispatcher.bridge_for(
            loop, lambda: LoopBridge(loop, self._handle, self._metrics, on_failure)
        )

    def _make_states(
        self,
        loaded: LoadedEngine,
        pending: LazySubmission,
        prompt_ids: list[int],
        params: SamplingParams,
        reasoning: ReasoningParser | None,
    ) -> tuple[ParentRequest, list[RequestState]]:
        return make_states(
            pending.request_id,
            self._handle.next_submission(),
            prompt_ids,
            params,
            pending.arrival,
            functools.partial(loaded.make_detokenizer, prompt_ids, params),
            max_backlog_bytes=self.config.max_stream_backlog_bytes,
            stream_interval=params.stream_interval or self.config.stream_interval,
            reasoning=reasoning,
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
            wait = self.config.max_queue_wait_s
            parent.collector.put(
                QueueTimeoutError(
                    f"request {parent.request_id} waited over max_queue_wait_s={wait} s"
                )
            )


def encode(loaded: LoadedEngine, source: PromptSource) -> list[int]:
    """The token ids of ``source`` (its chat rendered first); ``RequestError`` when bad."""
    prompt: Prompt = source.make(loaded.tokenizer)
    return loaded.admission.tokenize(prompt, source.add_special_tokens, source.param)


TASK_NAMES = {"generate": "text generation", "embed": "embeddings", "score": "scores"}


def check_task(loaded: LoadedEngine, wanted: str) -> None:
    """A ``RequestError`` (``param="model"``) for a request of a task the engine does not
    serve (``wanted``: "generate", "embed" or "score"): text from an embedder, an
    embedding from a chat model."""
    if wanted != loaded.task:
        raise RequestError(
            f"this model serves {TASK_NAMES[loaded.task]} (task={loaded.task!r}), "
            f"not {TASK_NAMES[wanted]}",
            param="model",
        )


def task_of(pooling: Pooling | None) -> str:
    """The task a request asks for: "generate" without a pooling."""
    if pooling is None:
        return "generate"
    return "embed" if pooling.head == "embed" else "score"


def check_pooled_length(loaded: LoadedEngine, num_tokens: int, param: str) -> None:
    """A pooling request's input must fit the model whole (no output follows it)."""
    limit = loaded.max_pooled_tokens
    if num_tokens > limit:
        raise RequestError(
            f"this model's maximum input length is {limit} tokens; the input has "
            f"{num_tokens} tokens (set truncate_prompt_tokens to cut it)",
            param=param,
        )


def admit_count(config: EngineConfig, handle: CoreHandle) -> None:
    """Refuse a request when ``max_queued_requests`` wait already (before tokenizing it)."""
    limit = config.max_queued_requests
    if limit is not None and handle.num_queued_requests >= limit:
        raise QueueFullError(
            f"too many queued requests ({handle.num_queued_requests} >= max_queued_requests={limit})"
        )


def admit_tokens(config: EngineConfig, handle: CoreHandle, num_tokens: int) -> None:
    """Refuse a prompt that would push the queued prompt tokens past ``max_queued_tokens``."""
    limit = config.max_queued_tokens
    if limit is not None and handle.num_queued_tokens + num_tokens > limit:
        raise QueueFullError(
            f"too many queued prompt tokens ({handle.num_queued_tokens} + {num_tokens} "
            f"> max_queued_tokens={limit})"
        )
