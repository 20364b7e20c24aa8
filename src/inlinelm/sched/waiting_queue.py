"""The scheduler's waiting queue: new and preempted requests in admission order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from inlinelm.sched.request import Request


class WaitingQueue:
    """Waiting and preempted requests, ordered by (priority, arrival time).

    A preempted request keeps its arrival time, so it goes back ahead of everything that
    arrived after it at the same priority.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, Request] = {}
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        """The queued requests, in no particular order."""
        return iter(list(self._live.values()))

    def push(self, request: Request) -> None:
        """Queue ``request`` at its place."""
        key = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, key)
        self._live[request.request_id] = request

    def peek(self) -> Request | None:
        """The next request to admit, or None when empty."""
        while self._heap:
            request = self._heap[0][3]
            if self._live.get(request.request_id) is request:
                return request
            heapq.heappop(self._heap)  # removed earlier: entries are dropped lazily, here
        return None

    def pop(self) -> Request:
        """Remove and return the next request to admit (the queue must not be empty)."""
        request = self.peek()
        assert request is not None, "pop() from an empty waiting queue"
        heapq.heappop(self._heap)
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        """Take ``request`` out of the queue if it is there."""
        if self._live.get(request.request_id) is request:
            del self._live[request.request_id]
