"""The seam between the engine thread and the event loops that host callers.

The engine thread calls :meth:`OutputDispatcher.post` once per step. Each live event loop
has one :class:`LoopBridge` (with its own output handler task and ``OutputProcessor``); a
post appends the step's batch to every bridge's deque and wakes each loop at most once
until its handler catches up, so a lagging loop coalesces steps instead of queueing
wake-ups. The other way, :class:`CoreHandle` hands requests and aborts to the engine
thread. Nothing else crosses threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from inlinelm.errors import EngineDeadError, RequestError, RequestFailedError
from inlinelm.runtime.metrics import EngineMetrics
from inlinelm.runtime.output_processor import OutputProcessor
from inlinelm.runtime.outputs import aborted_output
from inlinelm.runtime.request_state import ParentRequest
from inlinelm.sched.output import EngineCoreOutputs

if TYPE_CHECKING:
    from inlinelm.runtime.loader import LoadedEngine
    from inlinelm.sched.engine_core import EngineCore
    from inlinelm.sched.request import Request

logger = logging.getLogger(__name__)

SLICE_SIZE = 128


class CoreHandle:
    """The engine core while it runs, and the counts of requests still waiting to start.

    What the output handlers, timers and streams hold instead of the ``Engine``: a bridge
    that referenced the Engine would keep it alive as long as its event loop lives, so an
    Engine dropped without ``close()`` would never be collected. The handle carries only
    the running core (cleared on close, so the runner can be freed), the queue counters and
    the caller ids in flight.
    """

    def __init__(self) -> None:
        # The started engine's parts, set once loaded and cleared on close.
        self.loaded: LoadedEngine | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.num_queued_requests = 0
        self.num_queued_tokens = 0
        self._in_flight: dict[str, ParentRequest] = {}
        self._submissions = itertools.count()

    def claim(self, parent: ParentRequest) -> None:
        """Reserve ``parent``'s caller id; a ``RequestError`` if a request with that id is
        still in flight (on any event loop). Released by :meth:`forget`."""
        with self._lock:
            if parent.request_id in self._in_flight:
                raise RequestError(
                    f"request id {parent.request_id!r} is already in flight", param="request_id"
                )
            self._in_flight[parent.request_id] = parent

    def forget(self, parent: ParentRequest) -> None:
        """``parent`` left its loop's output processor: it is no longer queued, and its caller
        id is free again (idempotent; a newer request with the same id keeps its claim)."""
        self.unqueue(parent)
        with self._lock:
            if self._in_flight.get(parent.request_id) is parent:
                del self._in_flight[parent.request_id]

    @property
    def core(self) -> EngineCore | None:
        """The engine core while the engine runs."""
        loaded = self.loaded
        return None if loaded is None else loaded.core

    @property
    def num_in_flight(self) -> int:
        """Caller ids claimed and not released yet."""
        return len(self._in_flight)

    def next_submission(self) -> int:
        """A number no other submission to this engine gets (for engine-side ids)."""
        return next(self._submissions)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine thread to abort these requests (no-op once closed)."""
        core = self.core
        if core is not None and request_ids:
            core.abort(request_ids)

    def enqueue(self, parent: ParentRequest) -> None:
        """Count a request that waits for its first token."""
        parent.queued = True
        with self._lock:
            self.num_queued_requests += 1
            self.num_queued_tokens += len(parent.prompt_token_ids)

    def unqueue(self, parent: ParentRequest) -> None:
        """Stop counting ``parent`` as queued (idempotent)."""
        if parent.queued:
            parent.queued = False
            with self._lock:
                self.num_queued_requests -= 1
                self.num_queued_tokens -= len(parent.prompt_token_ids)

    def add(self, requests: Sequence[Request]) -> None:
        """Hand ``requests`` to the engine thread (the one way in besides :meth:`abort`)."""
        core = self.core
        if core is not None:
            for request in requests:
                core.add_request(request)

    def on_started(self, parent: ParentRequest) -> None:
        """A request's first token arrived: it left the queue; deferred choices may start."""
        self.unqueue(parent)
        if parent.deferred:
            self.add(parent.deferred)
        parent.deferred = []


class LoopBridge:
    """One event loop's end of the seam: a deque of step batches and its output handler."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        handle: CoreHandle,
        metrics: EngineMetrics,
        on_failure: Callable[[BaseException], BaseException],
    ) -> None:
        self.loop = loop
        self.processor = OutputProcessor(handle.on_started, handle.forget, metrics)
        self._core = handle
        self._metrics = metrics
        self._on_failure = on_failure
        self._batches: collections.deque[EngineCoreOutputs] = collections.deque()
        self._wake_pending = False
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._budget = SLICE_SIZE
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
                self._budget = SLICE_SIZE  # NOTE: the loop ran other tasks while we waited
                await self._drain()
        except Exception as exc:
            # NOTE: a fault outside any one request's processing (those fail only their
            # request): this loop's streams can no longer be trusted to progress, so the
            # engine is marked failed (see Engine docs) and every stream gets the error.
            logger.exception("the output handler failed")
            self.fail_all(self._on_failure(exc))
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
            self.processor.fail_all(dead)  # NOTE: the engine thread is gone: nothing to abort
            return
        self._metrics.observe_step(
            batch.step_end - batch.step_start, time.perf_counter() - batch.step_end
        )
        outputs = batch.outputs
        start, end = 0, len(outputs)
        while start < end:
            if not self._budget:
                # NOTE: invariant 3: at most SLICE_SIZE outputs between two yields, counted
                # across every batch this wake-up found (a lagging loop coalesces several).
                await asyncio.sleep(0)
                self._budget = SLICE_SIZE
            stop = min(end, start + self._budget)
            to_abort = self.processor.process_outputs(
                outputs if (start, stop) == (0, end) else outputs[start:stop], batch.step_start
            )
            self._budget -= stop - start
            start = stop
            if to_abort:
                self._core.abort(to_abort)

    def abort(self, parent: ParentRequest) -> None:
        """Abort ``parent`` (on this loop): forget it, free its queue slot and id, tell the
        engine thread, and end its stream with ``abort`` so no reader waits forever."""
        processor = self.processor
        if processor.parents.get(parent.request_id) is not parent:
            return  # finished, failed or aborted already
        open_choices = processor.open_choices(parent)
        self.drop(parent)
        parent.collector.put(aborted_output(parent, open_choices))
        # NOTE: counted by reason only: an aborted request's latencies would skew the histograms
        self._metrics.observe_finished("abort", None, [], None, parent.collector.num_merges)

    def drop(self, parent: ParentRequest) -> None:
        """Forget ``parent`` and abort its unfinished choices on the engine thread."""
        self._core.abort(self.processor.remove(parent))

    def abort_soon(self, parent: ParentRequest) -> None:
        """:meth:`abort` from any thread (or from a finalizer): scheduled on this loop."""
        with contextlib.suppress(RuntimeError):  # NOTE: a closed loop aborted everything
            self.loop.call_soon_threadsafe(self.abort, parent)

    def fail_all(self, error: BaseException) -> None:
        """End every stream of this loop with ``error`` and abort their requests (this loop)."""
        self._core.abort(self.processor.fail_all(error))

    def _close(self) -> None:
        """The handler stops (its loop is going away, or it failed): abort this loop's
        requests so the engine frees their blocks, and end their streams."""
        with self._lock:
            self.closed = True
            self._batches.clear()
        self.fail_all(RequestFailedError("the output handler of this event loop stopped"))


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


def fail_loops(dispatcher: OutputDispatcher, error: BaseException) -> None:
    """End every stream on every loop with ``error``, each on its own loop."""
    for bridge in dispatcher.bridges():
        with contextlib.suppress(RuntimeError):
            bridge.loop.call_soon_threadsafe(bridge.fail_all, error)


def close_loops(dispatcher: OutputDispatcher, error: BaseException) -> None:
    """The engine closed: end every stream on every loop with ``error``, then stop each
    loop's output handler (both on that loop)."""
    fail_loops(dispatcher, error)
    for bridge in dispatcher.bridges():
        with contextlib.suppress(RuntimeError):
            bridge.loop.call_soon_threadsafe(bridge.task.cancel)


def fail_engine(
    dispatcher: OutputDispatcher, handle: CoreHandle, cause: BaseException
) -> EngineDeadError:
    """An output handler failed: mark the engine failed, end every stream on every loop with
    ``EngineDeadError``, and stop the engine thread (it frees every request's blocks)."""
    error = EngineDeadError(f"the output handler failed: {type(cause).__name__}")
    error.__cause__ = cause
    if dispatcher.fatal_error is None:
        dispatcher.fatal_error = cause
    fail_loops(dispatcher, error)
    core = handle.core
    if core is not None:
        core.shutdown()
    return error


def engine_health(
    handle: CoreHandle,
    dispatcher: OutputDispatcher,
    heartbeat: Heartbeat,
    step_timeout_s: float,
    detail: bool,
) -> tuple[bool, str]:
    """``Engine.health``: ``(True, "ok")``, or ``(False, reason)`` when closed, dead, not
    started yet, or stuck in a step while callers wait."""
    if handle.closed:
        return False, "closed"
    error = dispatcher.fatal_error
    if error is not None:
        cause = type(error).__name__
        return False, f"dead: {cause}: {error}" if detail else f"dead: {cause}"
    if handle.loaded is None:
        return False, "starting"
    # NOTE: busy is judged by the requests callers wait for, not by the core's stats,
    # which are published after each step and so miss a first step that never ends.
    busy = any(bridge.processor.parents for bridge in dispatcher.bridges())
    idle_for = time.perf_counter() - heartbeat.last
    if busy and idle_for > step_timeout_s:
        return False, f"stuck: no engine step finished for {idle_for:.1f} s"
    return True, "ok"
