"""``RequestStream``: what ``Engine.stream`` returns — async-iterable, awaitable, closable."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any

from inlinelm.runtime.collector import RequestOutputCollector
from inlinelm.runtime.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """One request's outputs.

    ``async for out in stream`` yields ``RequestOutput`` deltas (per the request's
    output_kind); ``await stream`` returns the whole final ``RequestOutput``;
    ``await stream.aclose()`` aborts the request. Leaving an ``async for`` early, or a
    cancelled task, aborts it too. Iterate or await a stream once.
    """

    def __init__(
        self,
        request_id: str,
        submit: Callable[[], Awaitable[RequestOutputCollector]],
        abort: Callable[[], None],
        *,
        delta: bool,
    ) -> None:
        self.request_id = request_id
        self._submit = submit
        self._abort = abort
        self._delta = delta
        self._collector: RequestOutputCollector | None = None
        self._whole: RequestOutput | None = None
        self._done = False
        self._closed = False
        self._keep_whole = False  # only ``await stream`` needs the whole output

    def _attach(self, collector: RequestOutputCollector) -> None:
        self._collector = collector

    def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        return self._iterate()

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self._result().__await__()

    async def aclose(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        self._close()

    @property
    def finished(self) -> bool:
        """True once the last output was delivered."""
        return self._done

    async def _iterate(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            collector = self._collector or await self._submit()
            self._collector = collector
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
        if not self._done and not self._closed:
            self._abort()
        self._closed = True

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
        for choice in out.outputs:
            _fold(whole.outputs, choice, delta=self._delta)
        whole.outputs.sort(key=lambda c: c.index)


def _fold(choices: list[CompletionOutput], new: CompletionOutput, *, delta: bool) -> None:
    for i, old in enumerate(choices):
        if old.index == new.index:
            if delta:
                old.text += new.text
                old.token_ids.extend(new.token_ids)
                if new.logprobs is not None:
                    old.logprobs = (old.logprobs or []) + new.logprobs
                old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
            else:
                choices[i] = new
            return
    copy = CompletionOutput(
        new.index, new.text, list(new.token_ids), new.finish_reason, new.stop_reason, new.logprobs
    )
    choices.append(copy)
