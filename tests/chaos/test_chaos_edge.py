"""Chaos at the HTTP edge: huge request heads and hundreds of slow and idle connections,
while real streams flow through a server configured like ``inlinelm serve`` (``EdgeServer``
on ``server_config``: httptools with the edge protocol, uvicorn's limits), on this test's
event loop.

The bounds are derived from the configured limits, never bare numbers of seconds:

- every legitimate stream finishes with its exact text, and no gap between two of its
  chunks reaches ``request_timeout_s``: the server may not stall its streams for as long
  as it lets a client take to send one request (its gaps are milliseconds otherwise);
- a connection that sends nothing, or a head a byte at a time, is closed no earlier than
  ``request_timeout_s`` after it opened and within ``SLACK`` times that; an idle
  keep-alive connection within ``SLACK`` times ``keep_alive_timeout_s``;
- a head past ``max_header_bytes`` is cut (a 431, or the connection reset) long before
  the attacker has sent it all;
- afterwards the engine holds nothing (no request state, no KV block), the server holds
  no connection, and no task is left on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from inlinelm.api import create_app
from inlinelm.api.edge import EdgeServer, server_config
from inlinelm.api.edge_limits import EdgeLimits
from inlinelm.runtime.engine import Engine
from tests.chaos.helpers import (
    LoopServer,
    Problems,
    check_drained,
    check_no_stray_tasks,
    echo_answer,
    http_client,
    read_sse,
)
from tests.helpers import bound_address
from tests.runtime.helpers import echo_engine, prompt_ids, run, wait_until

LIMITS = EdgeLimits(request_timeout_s=2.0, keep_alive_timeout_s=1.0)
SLACK = 10
"""A deadline of T must have acted within SLACK × T (generous: a loaded 2-core machine)."""
GAP_BOUND_S = LIMITS.request_timeout_s

NUM_READERS = 16  # legitimate clients, each streaming one completion after another
NUM_SILENT = 200  # connect, send nothing
NUM_TRICKLE = 100  # send a head a byte every TRICKLE_S, never finishing it
NUM_IDLE = 100  # one whole request, then an idle keep-alive connection
NUM_BIG_HEADS = 6  # heads of BIG_HEAD_BYTES, each sent as fast as the server reads
TRICKLE_S = 0.1
BIG_HEAD_BYTES = 16 * 1024 * 1024
CHUNK = 64 * 1024
MAX_TOKENS = 48


@dataclass
class Edge:
    """One run: the server, its engine, and what went wrong."""

    engine: Engine
    server: EdgeServer
    problems: Problems = field(default_factory=Problems)
    max_gap_s: float = 0.0
    num_streams: int = 0

    @property
    def address(self) -> tuple[str, int]:
        return bound_address(self.server)

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.address)


# -- legitimate streams -----------------------------------------------------------------------


async def reader(edge: Edge, client: httpx.AsyncClient, index: int, done: asyncio.Event) -> None:
    """Stream completions one after another until the attack is over; check each exactly."""
    round_ = 0
    while not done.is_set() or round_ == 0:
        prompt = f"reader {index} round {round_}: the quick brown fox jumps over the lazy dog"
        expected = echo_answer(edge.engine, prompt_ids(edge.engine, prompt), MAX_TOKENS)
        arrivals: list[float] = []
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
        reading = await read_sse(
            client,
            f"{edge.url}/v1/completions",
            body,
            on_frame=lambda _, seen=arrivals: seen.append(time.perf_counter()),
        )
        label = f"stream {index}/{round_}"
        edge.problems.check(reading.status == 200, f"{label}: status {reading.status}")
        edge.problems.check(reading.done and not reading.errors, f"{label}: {reading.errors}")
        got = reading.texts.get(0)
        edge.problems.check(got == expected, f"{label}: text {got!r} != {expected!r}")
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        edge.max_gap_s = max([edge.max_gap_s, *gaps])
        edge.num_streams += 1
        round_ += 1


# -- hostile clients --------------------------------------------------------------------------


async def silent(edge: Edge, index: int) -> None:
    """Open a connection and send nothing; the server must close it at the deadline."""
    start = time.perf_counter()
    reader_, writer = await asyncio.open_connection(*edge.address)
    try:
        answer = await _until_closed(reader_, LIMITS.request_timeout_s * SLACK)
    finally:
        writer.close()
    waited = time.perf_counter() - start
    label = f"silent {index}"
    _check_closed_in_time(edge, label, answer, waited, LIMITS.request_timeout_s, early_ok=False)
    edge.problems.check(answer in (b"", None), f"{label}: answered {answer!r:.60}")


async def trickle(edge: Edge, index: int) -> None:
    """Send a head a byte at a time; the server must answer 408 and close at the deadline."""
    start = time.perf_counter()
    reader_, writer = await asyncio.open_connection(*edge.address)
    sender = asyncio.create_task(_trickle_bytes(writer))
    try:
        answer = await _until_closed(reader_, LIMITS.request_timeout_s * SLACK)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
    waited = time.perf_counter() - start
    label = f"trickle {index}"
    _check_closed_in_time(edge, label, answer, waited, LIMITS.request_timeout_s, early_ok=False)
    # NOTE: bytes still trickling in after the server closed may reset the connection
    # before its 408 is read; the close at the deadline is what counts.
    ok = answer is None or answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    edge.problems.check(ok, f"{label}: answered {answer!r:.60}")


async def _trickle_bytes(writer: asyncio.StreamWriter) -> None:
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
    with contextlib.suppress(ConnectionError):
        while True:
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(TRICKLE_S)  # the slowness under test, not a wait


async def idle(edge: Edge, index: int) -> None:
    """One whole request, then idle; uvicorn must close the keep-alive connection."""
    reader_, writer = await asyncio.open_connection(*edge.address)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        start = time.perf_counter()
        answer = await _until_closed(reader_, LIMITS.keep_alive_timeout_s * SLACK)
    finally:
        writer.close()
    waited = time.perf_counter() - start
    label = f"idle {index}"
    _check_closed_in_time(edge, label, answer, waited, LIMITS.keep_alive_timeout_s, early_ok=True)
    ok = answer is not None and answer.startswith(b"HTTP/1.1 200 ")
    edge.problems.check(ok, f"{label}: answered {answer!r:.60}")


async def big_head(edge: Edge, index: int) -> None:
    """Send a head of BIG_HEAD_BYTES (one huge header, or very many small ones) as fast as
    the server reads; it must be cut long before it is all sent."""
    reader_, writer = await asyncio.open_connection(*edge.address)
    one_header = index % 2 == 0
    sent = 0
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        filler = b"X-Big: " if one_header else b""
        line = b"a" * CHUNK if one_header else b"X-Many: 1\r\n" * (CHUNK // 11)
        writer.write(filler)
        with contextlib.suppress(ConnectionError):
            while sent < BIG_HEAD_BYTES:
                writer.write(line)
                await asyncio.wait_for(writer.drain(), LIMITS.request_timeout_s * SLACK)
                sent += len(line)
            writer.write(b"\r\n\r\n")
        answer = await _until_closed(reader_, LIMITS.request_timeout_s * SLACK)
    except TimeoutError:
        answer = None
    finally:
        writer.close()
    label = f"big head {index}"
    edge.problems.check(sent < BIG_HEAD_BYTES // 2, f"{label}: {sent} bytes sent before a cut")
    ok = answer is not None and (answer == b"" or answer.startswith(b"HTTP/1.1 431 "))
    edge.problems.check(ok, f"{label}: answered {answer!r:.60}")


async def _until_closed(stream: asyncio.StreamReader, timeout: float) -> bytes | None:
    """What the server sent until it closed the connection (a reset counts as closed);
    None if it was still open after ``timeout``."""
    chunks: list[bytes] = []

    async def read_all() -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await stream.read(65536):
                chunks.append(chunk)

    try:
        await asyncio.wait_for(read_all(), timeout)
    except TimeoutError:
        return None
    return b"".join(chunks)


def _check_closed_in_time(
    edge: Edge, label: str, answer: bytes | None, waited: float, limit: float, *, early_ok: bool
) -> None:
    if answer is None:
        edge.problems.add(f"{label}: still open after {limit * SLACK} s")
    elif not early_ok and waited < limit:
        edge.problems.add(f"{label}: closed after {waited:.2f} s, before its {limit} s deadline")


# -- the run ------------------------------------------------------------------------------------


async def _edge_run() -> Edge:
    baseline = set(asyncio.all_tasks())
    engine = echo_engine(echo_step_s=0.002, max_num_seqs=64)
    await engine.start()
    app = create_app(engine)
    config = server_config(
        app, host="127.0.0.1", port=0, limits=LIMITS, log_level="error", lifespan="off"
    )
    edge = Edge(engine, EdgeServer(config, engine, LIMITS))
    serving = LoopServer(edge.server)
    try:
        await serving.start()
        baseline.add(serving.task)
        await _attack(edge)
        await wait_until(
            lambda: not edge.server.server_state.connections, what="connections to close"
        )
        await check_drained(engine, edge.problems)
    finally:
        await serving.stop()
        await check_no_stray_tasks(baseline, engine, edge.problems)
        await engine.aclose()
    return edge


async def _attack(edge: Edge) -> None:
    """The hostile clients, all at once, while the readers stream until they are done."""
    done = asyncio.Event()
    async with http_client() as client:
        readers = [asyncio.create_task(reader(edge, client, i, done)) for i in range(NUM_READERS)]
        hostile: list[Coroutine[Any, Any, None]] = [
            *(silent(edge, i) for i in range(NUM_SILENT)),
            *(trickle(edge, i) for i in range(NUM_TRICKLE)),
            *(idle(edge, i) for i in range(NUM_IDLE)),
            *(big_head(edge, i) for i in range(NUM_BIG_HEADS)),
        ]
        for result in await asyncio.gather(*hostile, return_exceptions=True):
            if isinstance(result, BaseException):
                edge.problems.add(f"a hostile client failed: {result!r}")
        done.set()
        for result in await asyncio.gather(*readers, return_exceptions=True):
            if isinstance(result, BaseException):
                edge.problems.add(f"a reader failed: {result!r}")


def test_streams_flow_exactly_while_huge_heads_and_hundreds_of_slow_connections_are_cut() -> None:
    edge = run(_edge_run(), timeout=240.0)
    problems = edge.problems
    problems.check(edge.num_streams >= NUM_READERS, f"only {edge.num_streams} streams ran")
    problems.check(
        edge.max_gap_s < GAP_BOUND_S,
        f"a stream waited {edge.max_gap_s:.2f} s between two chunks (bound {GAP_BOUND_S} s)",
    )
    problems.assert_none(
        f"edge chaos ({edge.num_streams} streams, largest gap {edge.max_gap_s * 1000:.0f} ms)"
    )
