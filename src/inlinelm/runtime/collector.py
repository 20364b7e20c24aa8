"""The per-request collector: one slot between the output handler and the caller.

It never blocks and never queues: a second output that arrives before the caller took the
first merges into it (delta mode concatenates; other modes replace), per choice index. An
exception replaces whatever waits. Every merge is counted, so a backlog is observable.
"""

from __future__ import annotations

import asyncio
import logging

from inlinelm.runtime.outputs import RequestOutput, merge_choice

logger = logging.getLogger(__name__)

BACKLOG_WARNING_MERGES = 20


class RequestOutputCollector:
    """One slot holding the next ``RequestOutput`` (or an exception) for one request."""

    __slots__ = (
        "_delta",
        "_output",
        "_waiter",
        "backlog_bytes",
        "max_backlog_bytes",
        "num_merges",
        "pending_merges",
    )

    def __init__(self, *, delta: bool, max_backlog_bytes: int) -> None:
        self._delta = delta
        self._output: RequestOutput | BaseException | None = None
        # NOTE: a bare future, not an asyncio.Event: one waiter at most, and half the cost.
        self._waiter: asyncio.Future[None] | None = None
        self.num_merges = 0
        self.pending_merges = 0
        self.backlog_bytes = 0
        self.max_backlog_bytes = max_backlog_bytes

    def put(self, output: RequestOutput | BaseException) -> bool:
        """Hand over ``output`` without blocking; return False if the backlog overflowed."""
        current = self._output
        if current is None or isinstance(output, BaseException):
            self._output = output
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return True
        if isinstance(current, BaseException):
            return True  # NOTE: an error already waits; it wins over later outputs.
        self._merge(current, output)
        return self.backlog_bytes <= self.max_backlog_bytes

    def get_nowait(self) -> RequestOutput | None:
        """Take the waiting output, or None; raises the waiting exception."""
        output = self._output
        if output is None:
            return None
        self._output = None
        self.pending_merges = 0
        self.backlog_bytes = 0
        if isinstance(output, BaseException):
            raise output
        return output

    async def get(self) -> RequestOutput:
        """Wait for the next output; raises the exception put in its place."""
        output = self.get_nowait()
        while output is None:
            await self.ready()
            output = self.get_nowait()
        return output

    def ready(self) -> asyncio.Future[None]:
        """A future that completes at the next :meth:`put` (then :meth:`get_nowait`).

        A plain future rather than a coroutine: the reader awaits it with no extra frame.
        Only the latest one is completed; a cancelled or abandoned one is simply skipped.
        """
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        return waiter

    def _merge(self, current: RequestOutput, new: RequestOutput) -> None:
        for choice in new.outputs:
            merge_choice(current.outputs, choice, delta=self._delta)
        current.finished = new.finished
        current.num_cached_tokens = new.num_cached_tokens
        self.num_merges += 1
        self.pending_merges += 1
        new.metrics.num_merged_outputs += 1
        if self._delta:
            if self.pending_merges == 1:
                self.backlog_bytes = _utf8_len(current) - _utf8_len(new)
            self.backlog_bytes += _utf8_len(new)
        if self.pending_merges == BACKLOG_WARNING_MERGES:
            logger.warning(
                "request %s: %d outputs merged while its reader lagged",
                current.request_id,
                BACKLOG_WARNING_MERGES,
            )


def _utf8_len(output: RequestOutput) -> int:
    return sum(len(c.text.encode()) for c in output.outputs)
