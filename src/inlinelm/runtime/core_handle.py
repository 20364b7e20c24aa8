"""What the output handlers and timers hold instead of the ``Engine``.

A bridge that referenced the Engine would keep it alive as long as its event loop lives,
so an Engine dropped without ``close()`` would never be collected. The handle carries only
the running core (cleared on close, so the runner can be freed) and the queue counters.
"""

from __future__ import annotations

import threading

from inlinelm.runtime.engine_core import EngineCore
from inlinelm.runtime.request_state import ParentRequest


class CoreHandle:
    """The engine core while it runs, and the counts of requests still waiting to start."""

    def __init__(self) -> None:
        self.core: EngineCore | None = None
        self._lock = threading.Lock()
        self.num_queued_requests = 0
        self.num_queued_tokens = 0

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine thread to abort these requests (no-op once closed)."""
        core = self.core
        if core is not None and request_ids:
            core.abort(request_ids)

    def enqueue(self, parent: ParentRequest) -> None:
        """Count a request that waits for its first token."""
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
