"""The seam between the engine thread and the event loops that host callers.

The engine thread calls :meth:`OutputDispatcher.post` once per step. Each live event loop
has one :class:`LoopBridge` (with its own output handler task and ``OutputProcessor``); a
post appends the step's batch to every bridge's deque and wakes each loop at most once
until its handler catches up, so a lagging loop coalesces steps instead of queueing
wake-ups. Nothing else crosses threads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable

from inlinelm.errors import EngineDeadError
from inlinelm.runtime.metrics import EngineMetrics
from inlinelm.runtime.output_processor import OutputProcessor
from inlinelm.runtime.request_state import ParentRequest
from inlinelm.sched.output import EngineCoreOutputs

logger = logging.getLogger(__name__)

SLICE_SIZE = 128


class LoopBridge:
    """One event loop's end of the seam: a deque of step batches and its output handler."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[list[str]], None],
        on_started: Callable[[ParentRequest], None],
        metrics: EngineMetrics,
    ) -> None:
        self.loop = loop
        self.processor = OutputProcessor(on_started, metrics)
        self._abort = abort
        self._metrics = metrics
        self._batches: collections.deque[EngineCoreOutputs] = collections.deque()
        self._wake_pending = False
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self.closed = False
        self.num_coalesced_steps = 0
        # NOTE: the handler task holds the bridge, never the Engine, so dropping the Engine frees it.
        self.task = loop.create_task(self._run(), name="inlinelm-output-handler")

    # -- engine thread -----------------------------------------------------------------

    def post(self, batch: EngineCoreOutputs) -> bool:
        """Queue one step's batch and wake the loop if it is not already awake; False if closed."""
        with self._lock:
            if self.closed:
                return False
            self._batches.append(batch)
            if self._wake_pending:
                return True
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop closed under us
            self.closed = True
            return False
        return True

    # -- event loop --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                await self._drain()
        finally:
            self._close()

    async def _drain(self) -> None:
        handled = 0
        while True:
            with self._lock:
                if not self._batches:
                    self._wake_pending = False
                    # NOTE: every batch after the first in one wake-up waited for the loop.
                    self.num_coalesced_steps += max(handled - 1, 0)
                    return
                batch = self._batches.popleft()
            handled += 1
            await self._handle(batch)

    async def _handle(self, batch: EngineCoreOutputs) -> None:
        if batch.error is not None:
            dead = EngineDeadError(f"the engine thread died: {batch.error!r}")
            dead.__cause__ = batch.error
            self.processor.fail_all(dead)
            return
        self._metrics.observe_step(
            batch.step_end - batch.step_start, time.perf_counter() - batch.step_end
        )
        outputs = batch.outputs
        for start in range(0, len(outputs), SLICE_SIZE):
            if start:
                await asyncio.sleep(0)  # NOTE: invariant 3, yield to callers between slices.
            to_abort = self.processor.process_outputs(
                outputs[start : start + SLICE_SIZE], batch.step_start
            )
            if to_abort:
                self._abort(to_abort)

    def _close(self) -> None:
        """The loop is going away: abort this loop's requests so the engine frees their blocks."""
        with self._lock:
            self.closed = True
            self._batches.clear()
        ids = [
            cid
            for parent in list(self.processor.parents.values())
            for cid in self.processor.remove(parent)
        ]
        if ids:
            self._abort(ids)


class OutputDispatcher:
    """Routes each step's batch to every live event loop's bridge (engine thread side)."""

    def __init__(self) -> None:
        self._bridges: dict[asyncio.AbstractEventLoop, LoopBridge] = {}
        self._lock = threading.Lock()
        self.fatal_error: BaseException | None = None

    def bridge_for(
        self, loop: asyncio.AbstractEventLoop, factory: Callable[[], LoopBridge]
    ) -> LoopBridge:
        """The running loop's bridge, created on first use (and again after its loop closed)."""
        with self._lock:
            bridge = self._bridges.get(loop)
            if bridge is None or bridge.closed:
                bridge = factory()
                self._bridges[loop] = bridge
            return bridge

    def bridges(self) -> list[LoopBridge]:
        """The bridges of loops that are still open."""
        with self._lock:
            return [b for b in self._bridges.values() if not b.closed]

    def post(self, batch: EngineCoreOutputs) -> None:
        """Engine-thread sink: hand the batch to every open loop."""
        if batch.error is not None:
            self.fatal_error = batch.error
        with self._lock:
            bridges = list(self._bridges.items())
        for loop, bridge in bridges:
            if not bridge.post(batch):
                with self._lock:
                    self._bridges.pop(loop, None)


class Heartbeat:
    """When the engine last showed progress (a step posted, or a request added)."""

    __slots__ = ("last",)

    def __init__(self, last: float) -> None:
        self.last = last


def post_outputs(
    dispatcher: OutputDispatcher, heartbeat: Heartbeat, batch: EngineCoreOutputs
) -> None:
    """Engine-thread sink: one call per step."""
    heartbeat.last = time.perf_counter()
    if batch.error is not None:
        logger.error("the engine thread died: %r", batch.error)
    dispatcher.post(batch)
