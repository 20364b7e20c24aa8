"""Chaos-suite helpers: the seed, a problem list, an in-loop HTTP server, SSE reading,
injected faults and the leak checks run after each chaos run.

Everything runs on loopback with the echo runner. Waits are on events or on conditions
polled against a deadline; the only sleeps are in readers whose slowness is under test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from inlinelm import Engine
from inlinelm.api import create_app
from inlinelm.sched.output import SchedulerOutput
from tests.helpers import bound_address, bridges_of, core_of
from tests.runtime.helpers import (
    EOS,
    WAIT_S,
    RunnerFailure,
    cycled_ids,
    is_drained,
    num_live_states,
    runner_of,
)

DEFAULT_SEED = 20261201
SEED_ENV = "INLINELM_CHAOS_SEED"
EXCLUDE_ENV = "INLINELM_CHAOS_EXCLUDE"

FAULT_S = 10.0
"""How long after a fault every stream must have ended with an error."""

DRAIN_S = 10.0
"""How long after its last stream ended the engine may take to hold nothing."""


def chaos_seed() -> int:
    """The run's seed: ``$INLINELM_CHAOS_SEED``, or a fixed default."""
    return int(os.environ.get(SEED_ENV, DEFAULT_SEED))


def chaos_exclude() -> set[str]:
    """Scenario kinds left out of the mix: ``$INLINELM_CHAOS_EXCLUDE`` (comma-separated),
    for narrowing down a failure by hand; empty, so the full mix, by default."""
    return {k.strip() for k in os.environ.get(EXCLUDE_ENV, "").split(",") if k.strip()}


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[random.Random]:
    """A random generator for ``seed``; any failure inside is re-raised naming the seed."""
    try:
        yield random.Random(seed)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        run = f"{SEED_ENV}={seed}"
        if chaos_exclude():
            run += f" {EXCLUDE_ENV}={','.join(sorted(chaos_exclude()))}"
        raise AssertionError(f"[{run}] {type(exc).__name__}: {exc}") from exc


@dataclass
class Problems:
    """Everything that went wrong in one run, reported together rather than at the first."""

    items: list[str] = field(default_factory=list)

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.items.append(message)
        return ok

    def add(self, message: str) -> None:
        self.items.append(message)

    def assert_none(self, what: str, limit: int = 40) -> None:
        """Fail listing the problems grouped by shape (numbers and quoted texts masked),
        most frequent first, with one example each."""
        if not self.items:
            return
        groups: collections.Counter[str] = collections.Counter()
        example: dict[str, str] = {}
        for item in self.items:
            shape = re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", item))
            groups[shape] += 1
            example.setdefault(shape, item)
        lines = [f"{count} × {example[shape]}" for shape, count in groups.most_common(limit)]
        if len(groups) > limit:
            lines.append(f"… and {len(groups) - limit} more kinds of problem")
        shown = "\n  ".join(lines)
        raise AssertionError(f"{what}: {len(self.items)} problem(s)\n  {shown}")


# -- the echo runner's answers -------------------------------------------------------------


def echo_answer(engine: Engine, ids: list[int], max_tokens: int, stop: str | None = None) -> str:
    """The text the echo runner streams for prompt ``ids``: the prompt up to EOS (or up to
    ``max_tokens`` tokens), cut before the first ``stop`` string."""
    tokens: list[int] = []
    for token in cycled_ids(ids, max_tokens):
        if token == EOS:
            break
        tokens.append(token)
    text: str = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    if stop is not None and stop in text:
        text = text[: text.index(stop)]
    return text


# -- an HTTP server on the test's own event loop ---------------------------------------------


class LoopServer:
    """A uvicorn server (given port 0) as a task of the running loop, so its connection
    tasks count in ``asyncio.all_tasks()``: uvicorn's own (:meth:`of_engine`) or
    ``inlinelm serve``'s ``EdgeServer``.
    """

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def of_engine(cls, engine: Engine) -> LoopServer:
        """``create_app(engine)`` on 127.0.0.1 with the lifespan off: the test owns the
        engine and closes it itself."""
        config = uvicorn.Config(
            create_app(engine), host="127.0.0.1", port=0, log_level="error", lifespan="off"
        )
        return cls(uvicorn.Server(config))

    async def start(self) -> LoopServer:
        self.task = asyncio.create_task(self.server.serve(), name="chaos-uvicorn")
        deadline = time.perf_counter() + WAIT_S
        while not self.server.started:
            assert not self.task.done(), "uvicorn stopped during startup"
            assert time.perf_counter() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.005)
        return self

    @property
    def address(self) -> tuple[str, int]:
        return bound_address(self.server)

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.address)

    async def stop(self, timeout: float = WAIT_S) -> bool:
        """Stop serving; True if it stopped gracefully within ``timeout`` (else forced)."""
        assert self.task is not None
        self.server.should_exit = True
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        if done:
            return True
        self.server.force_exit = True
        await asyncio.wait({self.task}, timeout=timeout)
        if not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=timeout)
        return False


def http_client() -> httpx.AsyncClient:
    """A client for ~1,000 concurrent streams: no pool limit, no keep-alive reuse."""
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0))


@dataclass
class SseReading:
    """What one HTTP request got: status, per-choice texts and finish reasons, error frames."""

    status: int = 0
    body: Any = None
    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_frames: int = 0
    done: bool = False  # saw ``data: [DONE]``
    left_early: bool = False


async def read_sse(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    leave_after: int | None = None,
    slow_s: float = 0.0,
    on_frame: Callable[[int], None] | None = None,
) -> SseReading:
    """POST ``body`` and read its SSE stream; leave (close the connection) after
    ``leave_after`` data frames; sleep ``slow_s`` between frames (a slow reader)."""
    reading = SseReading()
    async with client.stream("POST", url, json=body) as response:
        reading.status = response.status_code
        if response.status_code != 200:
            raw = await response.aread()
            reading.body = json.loads(raw) if raw else None
            return reading
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                reading.done = True
                break
            _take_chunk(reading, json.loads(data))
            reading.num_frames += 1
            if on_frame is not None:
                on_frame(reading.num_frames)
            if leave_after is not None and reading.num_frames >= leave_after:
                reading.left_early = True
                return reading  # NOTE: leaving the block closes the unread connection.
            if slow_s:
                await asyncio.sleep(slow_s)  # the slow reader under test, not a wait
    return reading


def _take_chunk(reading: SseReading, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        reading.errors.append(chunk["error"])
        return
    for choice in chunk.get("choices", []):
        index = choice["index"]
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content") or ""
        reading.texts[index] = reading.texts.get(index, "") + text
        if choice.get("finish_reason") is not None:
            reading.reasons[index] = choice["finish_reason"]


# -- injected faults -------------------------------------------------------------------------


class FailAtStep:
    """The runner raises at its ``step``-th step from now (``RunnerFailure``, armed by a count)."""

    def __init__(self, engine: Engine, step: int) -> None:
        self.failure = RunnerFailure(engine)
        self.runner = runner_of(engine)
        self._inner = self.runner.submit
        self._step = step
        self._count = 0
        self.runner.submit = self._count_steps

    @property
    def failed_at(self) -> float | None:
        return self.failure.failed_at

    @property
    def error(self) -> BaseException:
        return self.failure.error

    def _count_steps(self, batch: SchedulerOutput) -> None:
        self._count += 1
        if self._count >= self._step:
            self.failure.arm()
        self._inner(batch)


class OutputHandlerFault:
    """Makes the processing of one batch on one loop raise, once (on the real processor)."""

    def __init__(self) -> None:
        self.error = RuntimeError("injected: the output handler fell over")
        self.failed_at: float | None = None
        self.fired = asyncio.Event()

    def install(self, monkeypatch: Any, engine: Engine) -> None:
        loop = asyncio.get_running_loop()
        bridges = [b for b in bridges_of(engine) if b.loop is loop]
        assert len(bridges) == 1, "this loop has no output handler yet"
        processor = bridges[0].processor
        original = processor.process_outputs

        def raise_once(*args: Any, **kwargs: Any) -> list[str]:
            if self.failed_at is None:
                self.failed_at = time.perf_counter()
                self.fired.set()
                raise self.error
            return original(*args, **kwargs)

        monkeypatch.setattr(processor, "process_outputs", raise_once)


# -- what must be left after a run -----------------------------------------------------------


def drain_report(engine: Engine) -> str:
    """Where an undrained engine still holds requests (for failure messages)."""
    core = core_of(engine)
    stats = core.stats
    return (
        f"live (states, parents)={num_live_states(engine)}, "
        f"queued={engine.stats()['num_queued']}, inputs_empty={core._inputs.empty()}, "
        f"scheduler_unfinished={core.scheduler.has_unfinished_requests()}, "
        f"running={stats.num_running}, waiting={stats.num_waiting}, "
        f"free_kv={engine.num_free_kv_blocks}/{engine.num_kv_blocks}"
    )


async def check_drained(engine: Engine, problems: Problems, timeout: float = DRAIN_S) -> None:
    """Wait (bounded) for the engine to hold nothing; record what it still holds if not."""
    deadline = time.perf_counter() + timeout
    while True:
        ok, reason = engine.health()
        if not ok and not reason.startswith("stuck"):
            problems.add(f"the engine cannot be checked for leaks: {reason}")
            return
        if is_drained(engine):
            return
        if time.perf_counter() > deadline:
            problems.add(f"the engine did not drain within {timeout} s: {drain_report(engine)}")
            return
        await asyncio.sleep(0.005)


async def check_released(engine: Engine, problems: Problems, timeout: float = DRAIN_S) -> None:
    """After a fatal fault: the engine thread has exited, and nothing is left of any request
    (no state on any loop, no queued count, every KV block back in the pool)."""
    core = core_of(engine)
    if not await asyncio.to_thread(core.join, timeout):
        problems.add(f"the engine thread still runs {timeout} s after the fault")
        return
    left = (
        num_live_states(engine),
        engine.stats()["num_queued"],
        core.scheduler.has_unfinished_requests(),
        core.stats.num_free_blocks == core.stats.num_kv_blocks,
    )
    problems.check(left == ((0, 0), 0, False, True), f"left after the fault: {left}")


SSE_WATCHER = "_shutdown_watcher"
"""sse-starlette's one task per event loop that watches for server shutdown (not per request)."""


def stray_tasks(baseline: set[asyncio.Task[Any]], engine: Engine | None) -> list[str]:
    """Tasks of this loop beyond ``baseline``, the current one and the engine's handlers.

    sse-starlette's shutdown watcher is allowed: one per event loop (not per request),
    started by the first SSE response; it outlives the server it watched.
    """
    own = {b.task for b in bridges_of(engine)} if engine is not None else set()
    current = asyncio.current_task()
    return sorted(
        f"{t.get_name()}: {t.get_coro()!r}"
        for t in asyncio.all_tasks()
        if t not in baseline
        and t is not current
        and t not in own
        and not t.done()
        and getattr(t.get_coro(), "__name__", "") != SSE_WATCHER
    )


async def check_no_stray_tasks(
    baseline: set[asyncio.Task[Any]], engine: Engine | None, problems: Problems
) -> None:
    """Tasks may take a few loop turns to finish their ``finally``: wait, bounded."""
    deadline = time.perf_counter() + WAIT_S
    while stray_tasks(baseline, engine):
        if time.perf_counter() > deadline:
            left = stray_tasks(baseline, engine)
            problems.add(f"{len(left)} stray asyncio task(s), e.g. {left[:3]}")
            return
        await asyncio.sleep(0.005)


def new_threads(before: set[threading.Thread], timeout: float = WAIT_S) -> list[str]:
    """Threads alive now that were not before (waits, bounded, for exiting ones)."""
    deadline = time.perf_counter() + timeout
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra or time.perf_counter() > deadline:
            return sorted(t.name for t in extra)
        time.sleep(0.005)


@contextlib.asynccontextmanager
async def served(engine: Engine) -> AsyncIterator[LoopServer]:
    """``engine`` started and served over HTTP on this loop for the duration of the block."""
    await engine.start()
    server = await LoopServer.of_engine(engine).start()
    try:
        yield server
    finally:
        await server.stop()
