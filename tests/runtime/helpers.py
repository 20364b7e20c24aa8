"""Shared helpers for the runtime tests.

Engines use ``runner="echo"`` unless a test needs a model: the answer is the prompt echoed
one token per step, then EOS, so every expected output is known exactly. Nothing here
sleeps to wait: waits are on events, or on a condition polled against a deadline when the
engine offers no event for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from inlinelm import Engine, RequestStream
from inlinelm.sched.output import SchedulerOutput
from tests.helpers import bridges_of, core_of

T = TypeVar("T")

WAIT_S = 20.0
"""Generous bound for anything that should happen soon (the machine may be loaded)."""

EOS = 2


def run(coro: Coroutine[Any, Any, T], timeout: float = 90.0) -> T:
    """``asyncio.run(coro)`` with a deadline, so a hang fails the test instead of the suite."""

    async def main() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


async def wait_until(
    predicate: Callable[[], bool], *, timeout: float = WAIT_S, what: str = "the condition"
) -> None:
    """Poll ``predicate`` on the loop (yielding each time) until true; fail after ``timeout``."""
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.001)


async def wait_event(event: threading.Event, timeout: float = WAIT_S) -> None:
    """Await a ``threading.Event`` set by the engine thread without blocking the loop."""
    assert await asyncio.to_thread(event.wait, timeout), "timed out waiting for a thread event"


def echo_engine(**options: Any) -> Engine:
    """An engine with the scripted echo runner (tokenizer only, no weights)."""
    return Engine(runner="echo", **options)


def prompt_ids(engine: Engine, prompt: str) -> list[int]:
    """The token ids the engine makes of ``prompt``."""
    ids: list[int] = engine.tokenizer.encode(prompt)
    return ids


def echo_text(engine: Engine, prompt: str) -> str:
    """What the echo runner answers to ``prompt`` (its tokens decoded, EOS skipped)."""
    text: str = engine.tokenizer.decode(prompt_ids(engine, prompt), skip_special_tokens=True)
    return text


def cycled_ids(ids: list[int], max_tokens: int) -> list[int]:
    """The echo runner's output with ``ignore_eos``: prompt, EOS, prompt, EOS … cut."""
    cycle = [*ids, EOS]
    return (cycle * (max_tokens // len(cycle) + 1))[:max_tokens]


def engine_ids(stream: RequestStream) -> list[str]:
    """The engine-side ids of a submitted stream's choices (unique per submission)."""
    submission = stream._submission
    assert submission is not None, "the stream was not submitted"
    return list(submission.parent.child_ids)


def num_live_states(engine: Engine) -> tuple[int, int]:
    """(request states, parent requests) still registered in every loop's output processor."""
    bridges = bridges_of(engine)
    return (
        sum(len(b.processor.states) for b in bridges),
        sum(len(b.processor.parents) for b in bridges),
    )


def is_drained(engine: Engine) -> bool:
    """No request anywhere: no state, no queued count, nothing scheduled, every block free.

    The published stats alone can be stale (they are taken after each step, so during a step
    blocked in the runner they still show the idle engine before it): the engine thread's
    input queue and scheduler must be empty too, i.e. every abort has really been applied.
    """
    core = core_of(engine)
    stats = core.stats
    return (
        num_live_states(engine) == (0, 0)
        and engine.stats()["num_queued"] == 0
        and core._inputs.empty()
        and not core.scheduler.has_unfinished_requests()
        and stats.num_running == 0
        and stats.num_waiting == 0
        and engine.num_free_kv_blocks == engine.num_kv_blocks
    )


async def assert_drained(engine: Engine, timeout: float = WAIT_S) -> None:
    """Wait until the engine holds nothing for any request (invariant 7), then check each part."""
    await wait_until(lambda: is_drained(engine), timeout=timeout, what="the engine to drain")
    assert num_live_states(engine) == (0, 0)
    assert engine.stats()["num_queued"] == 0
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def runner_of(engine: Engine) -> Any:
    """The engine thread's runner (the echo runner or the model runner)."""
    return core_of(engine).runner


class RunnerGate:
    """Wraps the runner's ``submit``: once :meth:`close` d, the next step blocks in it (like
    a device step that does not return) until :meth:`open`. Both the pipelined and the
    plain engine loop go through ``submit`` (the echo runner's ``execute`` calls it).

    Use as a context manager so a failing test never leaves the engine thread blocked.
    """

    def __init__(self, engine: Engine) -> None:
        self.runner = runner_of(engine)
        self._submit = self.runner.submit
        self._closed = threading.Event()
        self._released = threading.Event()
        self.entered = threading.Event()
        self.runner.submit = self._gated

    def close(self) -> None:
        """Block the next step (and every later one) until :meth:`open`."""
        self.entered.clear()
        self._released.clear()
        self._closed.set()

    def open(self) -> None:
        """Let the blocked step (and the ones after it) run."""
        self._closed.clear()
        self._released.set()

    def _gated(self, batch: SchedulerOutput) -> None:
        if self._closed.is_set():
            self.entered.set()
            self._released.wait(WAIT_S)
        self._submit(batch)

    def __enter__(self) -> RunnerGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
        self.runner.submit = self._submit


class RunnerFailure:
    """Wraps the runner's ``submit``: once :meth:`arm` ed, the next step raises ``error``."""

    def __init__(self, engine: Engine) -> None:
        self.runner = runner_of(engine)
        self._submit = self.runner.submit
        self._armed = threading.Event()
        self.error = RuntimeError("injected: the device fell over")
        self.failed_at: float | None = None
        self.runner.submit = self._maybe_fail

    def arm(self) -> None:
        self._armed.set()

    def _maybe_fail(self, batch: SchedulerOutput) -> None:
        if self._armed.is_set():
            self.failed_at = time.perf_counter()
            raise self.error
        self._submit(batch)
