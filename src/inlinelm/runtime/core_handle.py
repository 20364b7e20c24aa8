"""What the output handlers, timers and streams hold instead of the ``Engine``.

A bridge that referenced the Engine would keep it alive as long as its event loop lives,
so an Engine dropped without ``close()`` would never be collected. The handle carries only
the running core (cleared on close, so the runner can be freed), the queue counters and
the caller ids in flight.
"""

from __future__ import annotations

import itertools
import threading

from inlinelm.errors import RequestError
from inlinelm.runtime.request_state import ParentRequest
from inlinelm.sched.engine_core import EngineCore


class CoreHandle:
    """The engine core while it runs, and the counts of requests still waiting to start."""

    def __init__(self) -> None:
        self.core: EngineCore | None = None
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

    def on_started(self, parent: ParentRequest) -> None:
        """A request's first token arrived: it left the queue; deferred choices may start."""
        self.unqueue(parent)
        core = self.core
        if parent.deferred and core is not None:
            for request in parent.deferred:
                core.add_request(request)
        parent.deferred = []
