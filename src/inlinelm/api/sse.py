"""Server-sent events: engine outputs → OpenAI chunks → ``data:`` frames, then ``[DONE]``.

The stream of one request, in order:

1. an opening chunk per choice (chat: the role; completions with ``echo``: the prompt);
2. a chunk per choice and engine step that released text (a step that released nothing —
   held-back bytes or a stop-string prefix — sends nothing);
3. per choice, the real ``finish_reason`` on its last content chunk (or on a closing chunk
   with an empty delta when the finishing step released no text);
4. with ``include_usage``, one chunk with empty ``choices`` and the usage;
5. ``data: [DONE]``.

An error after the 200 replaces the rest with ``data: {"error": {...}}`` and ``[DONE]``;
so does the server stopping (uvicorn's Ctrl-C or SIGTERM, as sse-starlette detects it):
each open stream ends with an ``engine_closed`` error frame and ``[DONE]`` before the
server goes on to close the engine. The generator aborts its engine requests in its
``finally``, and :class:`EventStreamResponse` closes it as soon as the response ends,
however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import orjson
from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

from inlinelm.api.errors import from_exception
from inlinelm.api.formats import ChoiceFormat
from inlinelm.api.responses import ResponseHeader
from inlinelm.errors import EngineClosedError, EngineError, RequestError, RequestFailedError
from inlinelm.runtime.outputs import RequestOutput, TokenLogprobs

logger = logging.getLogger("inlinelm.api")

DONE = "[DONE]"
SHUTDOWN_GRACE_S = 5.0
"""How long an open stream has, once the server stops, to send its error frame and
``[DONE]`` (a client that reads nothing is cut after it)."""


def frame(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (UTF-8 JSON, or ``[DONE]``) as its data."""
    return b"data: " + payload + b"\n\n"


_DONE_FRAME = frame(DONE.encode())


class OutputStream(Protocol):
    """What ``Engine.stream`` / ``Engine.chat`` return, as far as the router needs it."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def __await__(self) -> Generator[Any, None, RequestOutput]: ...

    async def aclose(self) -> None:
        """Abort the request if it still runs (idempotent)."""

    async def submit(self) -> None:
        """Hand the request to the engine if not yet; raises what validation raises."""

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: its next read raises it."""


class HttpMetrics(Protocol):
    """The engine's sink for latencies measured at the HTTP layer."""

    def observe_http_ttft(self, seconds: float) -> None: ...

    def observe_http_itl(self, seconds: float) -> None: ...


@dataclass(slots=True)
class StreamTally:
    """What one response sent: usage, finish reasons and write times (for metrics and the log).

    ``arrival`` is ``time.perf_counter()`` when the request reached the router.
    """

    arrival: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None  # a reasoning model's chat: its choices' reasoning
    finish_reasons: dict[int, str] = field(default_factory=dict)
    first_write: float | None = None
    last_write: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_write is None else self.first_write - self.arrival

    def wrote_tokens(self, metrics: HttpMetrics) -> None:
        """Record that a step's text has just been written: TTFT the first time, ITL after."""
        now = time.perf_counter()
        if self.last_write is None:
            self.first_write = now
            metrics.observe_http_ttft(now - self.arrival)
        else:
            metrics.observe_http_itl(now - self.last_write)
        self.last_write = now


@dataclass(slots=True)
class StreamPlan:
    """Everything :func:`event_stream` needs besides the engine streams."""

    header: ResponseHeader
    format: ChoiceFormat
    n: int
    metrics: HttpMetrics
    tally: StreamTally
    on_done: Callable[[StreamTally], None]
    text_frame: TextFrame | None = None
    # Called with (choice index, output) for an output that brings the prompt's logprobs.
    on_prompt: Callable[[int, RequestOutput], None] | None = None


def encode(payload: dict[str, Any]) -> bytes:
    """One frame's data: compact UTF-8 JSON, non-ASCII kept as is (as OpenAI sends it).

    orjson writes the bytes ``json.dumps(payload, ensure_ascii=False, separators=(",", ":"))``
    would, but for floats under 1e-4, which it writes without an exponent (``0.000012`` for
    ``1.2e-05``: the same number to any JSON parser), and NaN/infinity, which it writes as
    ``null`` (stdlib JSON writes ``NaN``, which is not JSON). A test pins both.
    """
    return orjson.dumps(payload)


async def event_stream(streams: Sequence[OutputStream], plan: StreamPlan) -> AsyncIterator[bytes]:
    """The SSE frames for the engine ``streams`` (one per prompt), then ``[DONE]``.

    Choice ``j`` of prompt ``i`` has index ``i * plan.n + j``. Always aborts every stream
    before it ends, and calls ``plan.on_done`` exactly once.
    """
    header, fmt, tally = plan.header, plan.format, plan.tally
    try:
        # NOTE: the frames are made here, not in a nested generator: one async generator
        # fewer between the collector and the socket, on every token.
        try:
            for index in range(len(streams) * plan.n):
                opening = fmt.opening(index)
                if opening is not None:
                    yield frame(encode(header.chunk(fmt.chunk_object, [opening])))
            held: dict[int, list[TokenLogprobs]] = {}
            if len(streams) == 1:
                first = True
                async for out in streams[0]:
                    if first:
                        first = False
                        tally.prompt_tokens += len(out.prompt_token_ids)
                    data, has_text = _step_frames(out, 0, plan, held)
                    if data:
                        yield data
                        if has_text:
                            tally.wrote_tokens(plan.metrics)
            else:
                async for data in _merged_chunks(streams, plan, held):
                    yield data
            if header.include_usage:
                usage = header.usage_chunk(
                    fmt.chunk_object,
                    tally.prompt_tokens,
                    tally.completion_tokens,
                    tally.reasoning_tokens,
                )
                yield frame(encode(usage))
        except Exception as exc:
            yield frame(_error_frame(exc, tally))
        yield _DONE_FRAME
    finally:
        # NOTE: shielded, because a cancelled task group re-raises on every await, and an
        # abort that never reaches the engine would pin the request's KV blocks.
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await stream.aclose()
        plan.on_done(plan.tally)


async def _merged_chunks(
    streams: Sequence[OutputStream], plan: StreamPlan, held: dict[int, list[TokenLogprobs]]
) -> AsyncIterator[bytes]:
    """The content frames of several streams (one per prompt) as each one produces."""
    tally = plan.tally
    counted: set[int] = set()
    async with aclosing(merge_streams(streams)) as outputs:
        async for prompt_index, out in outputs:
            if prompt_index not in counted:
                counted.add(prompt_index)
                tally.prompt_tokens += len(out.prompt_token_ids)
            data, has_text = _step_frames(out, prompt_index * plan.n, plan, held)
            if data:
                yield data
                if has_text:
                    tally.wrote_tokens(plan.metrics)


def _step_frames(
    out: RequestOutput, base: int, plan: StreamPlan, held: dict[int, list[TokenLogprobs]]
) -> tuple[bytes, bool]:
    """The frames of one engine step, as one write (``b""`` for a silent step), and whether
    any of them carries text.

    ``held`` keeps the logprobs of tokens whose text was held back, per choice, so they
    travel with the text they belong to.
    """
    header, fmt, tally = plan.header, plan.format, plan.tally
    data = b""
    has_text = False
    if out.prompt_logprobs is not None and plan.on_prompt is not None:
        for choice in out.outputs:
            plan.on_prompt(base + choice.index, out)
    for choice in out.outputs:
        index = base + choice.index
        tally.completion_tokens += len(choice.token_ids)
        logprobs = choice.logprobs or []
        if held and index in held:
            logprobs = held.pop(index) + logprobs
        reason = choice.finish_reason
        if reason is not None:
            tally.finish_reasons[index] = reason
            if choice.reasoning_tokens is not None:
                tally.reasoning_tokens = (tally.reasoning_tokens or 0) + choice.reasoning_tokens
        if choice.text or choice.reasoning:
            # NOTE: the last content chunk carries the real finish_reason itself.
            if plan.text_frame is not None and not logprobs:
                has_text = True
                data += plan.text_frame.render(index, choice.text, reason)
                continue
            delta = fmt.delta(index, choice.text, logprobs, reason, choice.reasoning)
            if delta is not None:
                has_text = True
                data += frame(encode(header.chunk(fmt.chunk_object, [delta])))
        elif reason is not None:
            closing = fmt.finish(index, reason, logprobs)
            data += frame(encode(header.chunk(fmt.chunk_object, [closing])))
        elif logprobs:
            held[index] = logprobs
    return data, has_text


def _error_frame(exc: Exception, tally: StreamTally) -> bytes:
    error = from_exception(exc)
    if not isinstance(exc, (RequestFailedError, EngineError, RequestError)):
        logger.exception("stream failed after the response started")
    tally.error = error.code
    return encode(error.body())


async def merge_streams(
    streams: Sequence[OutputStream],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """``(stream index, output)`` from several streams as each one produces.

    One stream (the usual case) is read directly, with no task per step.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    iterators = [aiter(s) for s in streams]
    pending = {asyncio.ensure_future(_next(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                result = task.result()
                if result is None:
                    continue
                yield index, result
                pending[asyncio.ensure_future(_next(iterators[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        if pending:
            # NOTE: wait for the cancelled reads to unwind before the streams are closed.
            with anyio.CancelScope(shield=True):
                await asyncio.wait(pending)


async def _next(iterator: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return None


@dataclass(frozen=True, slots=True)
class TextFrame:
    """The hot path: a content chunk without logprobs, as bytes, without building a dict.

    Byte-for-byte what ``frame(encode(header.chunk(...)))`` gives for such a chunk (a test
    pins it); the chunk's fixed head and tail are encoded once per request.
    """

    head: bytes
    tail: bytes

    @classmethod
    def for_chat(cls, header: ResponseHeader, object_name: str) -> TextFrame:
        """The template of ``chat.completion.chunk`` content frames of one request."""
        marker = "\x00"
        sample = encode(header.chunk(object_name, [{"index": 0, "delta": {"content": marker}}]))
        head, tail = sample.split(b'{"index":0,"delta":{"content":"\\u0000"}}')
        return cls(b"data: " + head + b'{"index":', tail + b"\n\n")

    def render(self, index: int, text: str, reason: str | None) -> bytes:
        finish = b"null" if reason is None else orjson.dumps(reason)
        # NOTE: one %-format of bytes: fewer temporaries than f-string, encode and concat.
        return _TEXT_FRAME % (self.head, index, orjson.dumps(text), finish, self.tail)


_TEXT_FRAME = b'%s%d,"delta":{"content":%s},"logprobs":null,"finish_reason":%s}%s'


class EventStreamResponse(EventSourceResponse):
    """An ``EventSourceResponse`` that closes its generator the moment the response ends.

    A client that goes away is not always delivered to the generator as a cancellation:
    when it sits at a ``yield`` (a send in flight, a ping failing) nothing reaches it, and
    its ``finally`` would wait for garbage collection. Closing it here runs the abort at once.
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        ping_s: float,
        streams: Sequence[OutputStream] = (),
    ) -> None:
        """``events`` are the frames of the engine ``streams``; when the server stops, each
        of ``streams`` is failed with ``EngineClosedError``, so ``events`` end with an error
        frame and ``[DONE]`` within :data:`SHUTDOWN_GRACE_S` (then the response is cut)."""
        self._shutdown = anyio.Event()
        self._streams = streams
        super().__init__(
            events,
            ping=ping_s,
            sep="\n",
            shutdown_event=self._shutdown,
            shutdown_grace_period=SHUTDOWN_GRACE_S if streams else 0,
            # NOTE: sse-starlette runs this beside the stream and cancels it when the
            # response ends: the one task that waits for the server to stop.
            data_sender_callable=self._end_on_shutdown if streams else None,
        )
        self._events = events

    async def _end_on_shutdown(self) -> None:
        await self._shutdown.wait()
        for stream in self._streams:
            stream.fail(EngineClosedError("the server is shutting down"))

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        # NOTE: with no send timeout, skip the cancel scope sse-starlette opens per frame
        # (a third of the loop's time per frame at 256 streams, measured by py-spy).
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
