"""``RequestStream``: what ``Engine.stream`` returns — async-iterable, awaitable, closable."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from inlinelm.runtime.bridge import LoopBridge
from inlinelm.runtime.collector import RequestOutputCollector
from inlinelm.runtime.outputs import RequestOutput, merge_choice
from inlinelm.runtime.request_state import ParentRequest


@dataclass(frozen=True, slots=True)
class Submission:
    """A request handed to the engine: its state, and the bridge of the loop it lives on."""

    parent: ParentRequest
    bridge: LoopBridge

    def abort(self) -> None:
        """Abort the request from any thread: at once on its own loop, else scheduled there."""
        bridge = self.bridge
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is bridge.loop:
            bridge.abort(self.parent)
        else:
            bridge.abort_soon(self.parent)


class Pending(Protocol):
    """A request not handed to the engine yet (``runtime.submission.LazySubmission``)."""

    async def submit(self) -> Submission:
        """Hand the request over (starting the engine, tokenizing, compiling first)."""
        ...


class RequestStream:
    """One request's outputs.

    ``async for out in stream`` yields ``RequestOutput`` deltas (per the request's
    output_kind); ``await stream`` returns the whole final ``RequestOutput``;
    ``await stream.aclose()`` aborts the request. Leaving an ``async for`` early, or a
    cancelled task, aborts it too (after a ``break``, when Python closes the iterator, one
    loop turn later; its request id is in flight until then). So does dropping a stream
    unread, from any thread. Iterate or await a stream once.
    """

    def __init__(
        self,
        request_id: str,
        pending: Pending,
        *,
        delta: bool,
    ) -> None:
        self.request_id = request_id
        self._pending = pending
        self._delta = delta
        self._submission: Submission | None = None
        self._collector: RequestOutputCollector | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._whole: RequestOutput | None = None
        self._done = False
        self._closed = False
        self._error: BaseException | None = None  # failed before it was submitted
        self._keep_whole = False  # only ``await stream`` needs the whole output

    def _attach(self, submission: Submission) -> None:
        self._submission = submission
        self._collector = submission.parent.collector
        # NOTE: a stream dropped unread (garbage-collected) aborts its request; the
        # finalizer holds the bridge and the request state, never the stream.
        self._finalizer = weakref.finalize(self, submission.bridge.abort_soon, submission.parent)

    async def submit(self) -> None:
        """Hand the request to the engine now if that has not happened yet (idempotent).

        ``Engine.stream`` submits at once when it can; a large prompt is tokenized off the
        event loop first, and an engine that is not started starts first, so then the
        request is submitted here (or by the first ``async for``/``await``), and bad input
        raises ``RequestError`` here.
        """
        if self._submission is None and not self._closed:
            self._attach(await self._pending.submit())

    def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        return self._iterate()

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self._result().__await__()

    async def aclose(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        self._close()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: the reader's next read raises it, in place of any
        output not read yet, and the request is aborted as the reader leaves. Does nothing
        to a stream that finished or was closed. Call it on the stream's event loop."""
        if self._done or self._closed:
            return
        if self._collector is None:
            self._error = error
        else:
            self._collector.put(error)

    @property
    def finished(self) -> bool:
        """True once the last output was delivered."""
        return self._done

    async def _iterate(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            await self.submit()
            if self._error is not None:
                raise self._error
            collector = self._collector
            if collector is None:
                return  # NOTE: closed before it was ever submitted
            while not self._done:
                out = collector.get_nowait()
                while out is None:
                    await collector.ready()
                    out = collector.get_nowait()
                if self._keep_whole:
                    self._accumulate(out)
                self._done = out.finished
                yield out
        finally:
            # NOTE: cancellation, an exception or GeneratorExit (the reader left) all land here.
            self._close()

    async def _result(self) -> RequestOutput:
        self._keep_whole = True
        async for _ in self:
            pass
        assert self._whole is not None
        return self._whole

    def _close(self) -> None:
        if not self._done and not self._closed and self._submission is not None:
            self._submission.abort()
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()

    def _accumulate(self, out: RequestOutput) -> None:
        if self._whole is None:
            self._whole = RequestOutput(
                out.request_id,
                [],
                out.finished,
                out.prompt_token_ids,
                out.metrics,
                out.num_cached_tokens,
            )
        whole = self._whole
        whole.finished = out.finished
        whole.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            whole.pooled = out.pooled
        if out.prompt_logprobs is not None:
            whole.prompt_logprobs = out.prompt_logprobs
        for choice in out.outputs:
            merge_choice(whole.outputs, choice, delta=self._delta, copy=True)
        whole.outputs.sort(key=lambda c: c.index)
