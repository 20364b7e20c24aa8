"""The HTTP edge of ``inlinelm serve`` (``inlinelm.api.edge``): a capped request head, a
deadline for a request to arrive, idle keep-alive connections closed, and a bound on
connections, on the server ``inlinelm serve`` runs (uvloop, httptools, the edge protocol).

Hostile clients are raw sockets. Each wait for the server to act is bounded by a multiple
of the timeout under test (``SLACK``), never by a bare number of seconds; a deadline is
also checked not to fire early (measured from before the client connected).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from inlinelm.api import create_app
from inlinelm.api.edge import EdgeServer, edge_protocol, server_config
from inlinelm.api.edge_limits import EdgeLimits
from inlinelm.errors import ConfigError
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO, ReadyOnStartup, ServerThread
from tests.test_cli import _wait_until_serving, serve_command

LIMITS = EdgeLimits(
    max_header_bytes=4096, request_timeout_s=0.5, keep_alive_timeout_s=0.5, max_connections=64
)
SLACK = 40
"""A deadline of T must have acted within SLACK × T (generous: a loaded 2-core machine)."""
EARLY_S = 0.002
"""How early a deadline may fire: uvloop's timers are libuv's, whole milliseconds counted from
the loop time cached at the start of its iteration, so one can fire up to a millisecond (and a
rounding) before ``time.monotonic()`` says T has passed (0.49992 s for 0.5 s was seen in CI)."""
WAIT_S = 60.0


class EdgeThread(ServerThread):
    """:class:`EdgeServer` on a free port of 127.0.0.1 in a thread, as ``inlinelm serve``
    configures it (``server_config``), for the duration of a ``with`` block."""

    def __init__(self, limits: EdgeLimits, **engine_options: Any) -> None:
        self.engine = Engine(ECHO.with_options(**engine_options))
        config = server_config(
            create_app(self.engine), host="127.0.0.1", port=0, limits=limits, log_level="warning"
        )
        super().__init__(_ReadyServer(config, self.engine, limits), name="edge-test")

    def __enter__(self) -> EdgeThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=WAIT_S)

    def num_connections(self) -> int:
        return len(self.server.server_state.connections)


class _ReadyServer(ReadyOnStartup, EdgeServer):
    """``inlinelm serve``'s server, with the ``ready`` event :class:`ServerThread` awaits."""


@pytest.fixture(scope="module")
def edge() -> Iterator[EdgeThread]:
    with EdgeThread(LIMITS) as server:
        yield server


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def send(sock: socket.socket, data: bytes) -> None:
    """Send what a hostile client sends; the server may close before it is all sent."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)


def head(path: str = "/health", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode()


# -- the head cap -----------------------------------------------------------------------------


def test_a_head_past_the_cap_is_a_431_and_the_connection_closes(edge: EdgeThread) -> None:
    with edge.connect() as sock:
        send(sock, head(extra=f"X-Big: {'a' * LIMITS.max_header_bytes}\r\n"))
        answer = read_until_closed(sock, LIMITS.request_timeout_s * SLACK)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert b"connection: close" in answer


def test_many_small_headers_count_toward_the_cap(edge: EdgeThread) -> None:
    with edge.connect() as sock:
        send(sock, head(extra="".join(f"X-{i}: {i}\r\n" for i in range(1000))))
        assert read_until_closed(sock, LIMITS.request_timeout_s * SLACK).startswith(b"HTTP/1.1 431")


def test_a_head_under_the_cap_is_served_with_its_body_in_the_same_packet(
    edge: EdgeThread,
) -> None:
    body = b'{"prompt": "' + b"x" * 20000 + b'", "max_tokens": 1}'
    padding = "a" * (LIMITS.max_header_bytes - 300)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Pad: {padding}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    assert len(request) < LIMITS.max_header_bytes
    with edge.connect() as sock:
        sock.sendall(request + body)
        answer = read_until_closed(sock, WAIT_S)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_pipelined_requests_in_one_packet_are_all_answered(edge: EdgeThread) -> None:
    with edge.connect() as sock:
        sock.sendall(head() * 3 + head(extra="connection: close\r\n"))
        answer = read_until_closed(sock, WAIT_S)
    assert answer.count(b"HTTP/1.1 200 OK") == 4, answer


# -- the request deadline ---------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(edge: EdgeThread) -> None:
    start = time.monotonic()
    with edge.connect() as sock:
        answer = read_until_closed(sock, LIMITS.request_timeout_s * SLACK)
    waited = time.monotonic() - start
    assert answer == b""
    assert LIMITS.request_timeout_s - EARLY_S <= waited < LIMITS.request_timeout_s * SLACK


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_deadline_with_a_408(
    edge: EdgeThread,
) -> None:
    start = time.monotonic()
    with edge.connect() as sock:
        sender = threading.Thread(target=_trickle, args=(sock, b"GET /health HTTP/1.1\r\nX: "))
        sender.start()
        answer = read_until_closed(sock, LIMITS.request_timeout_s * SLACK)
        waited = time.monotonic() - start
        sender.join(WAIT_S)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert LIMITS.request_timeout_s - EARLY_S <= waited < LIMITS.request_timeout_s * SLACK


def _trickle(sock: socket.socket, start: bytes) -> None:
    """A slow client: ``start``, then one header byte every 20 ms until the server closes."""
    try:
        sock.sendall(start)
        while True:
            sock.sendall(b"a")
            time.sleep(0.02)  # the slowness under test, not a wait
    except OSError:
        return


def test_a_body_that_never_arrives_is_cut_and_never_reaches_the_engine(
    edge: EdgeThread,
) -> None:
    finished = edge.engine.stats()["finished"]
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
        b'{"prompt": "half a bo'
    )
    start = time.monotonic()
    with edge.connect() as sock:
        sock.sendall(request)
        answer = read_until_closed(sock, LIMITS.request_timeout_s * SLACK)
    waited = time.monotonic() - start
    assert (
        answer == b""
        and LIMITS.request_timeout_s - EARLY_S <= waited < LIMITS.request_timeout_s * SLACK
    )
    stats = edge.engine.stats()
    assert stats["finished"] == finished and stats["num_running"] == stats["num_queued"] == 0


def test_a_stream_longer_than_the_request_timeout_is_not_cut() -> None:
    with EdgeThread(LIMITS, echo_step_s=0.01) as server:
        body = {"prompt": "go", "max_tokens": 150, "ignore_eos": True, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as r:
            frames = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert time.monotonic() - start > LIMITS.request_timeout_s  # else this tests nothing
    assert '"finish_reason":"length"' in frames[-1]


def test_an_idle_keep_alive_connection_closes_after_its_timeout(edge: EdgeThread) -> None:
    with edge.connect() as sock:
        sock.sendall(head())
        start = time.monotonic()
        answer = read_until_closed(sock, LIMITS.keep_alive_timeout_s * SLACK)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"status":"ok"}')
    assert time.monotonic() - start < LIMITS.keep_alive_timeout_s * SLACK


# -- the connection bound ---------------------------------------------------------------------


def test_a_full_server_answers_503_and_serves_again_once_connections_close() -> None:
    limits = EdgeLimits(request_timeout_s=60.0, max_connections=3)
    with EdgeThread(limits) as server:
        idle = [server.connect() for _ in range(3)]
        deadline = time.monotonic() + WAIT_S
        while server.num_connections() < 3:
            assert time.monotonic() < deadline, "the server did not take the connections"
            time.sleep(0.01)
        full = httpx.get(f"{server.url}/health", timeout=WAIT_S)
        assert full.status_code == 503 and full.text == "Service Unavailable"
        for sock in idle:
            sock.close()
        while server.num_connections() > 0:
            assert time.monotonic() < deadline, "the server kept closed connections"
            time.sleep(0.01)
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"max_header_bytes": 100}, "max_header_bytes"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"keep_alive_timeout_s": -1}, "keep_alive_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_limits_that_cannot_work_are_config_errors(options: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError) as info:
        EdgeLimits(**options)
    assert info.value.option == option


def test_an_app_on_its_own_uvicorn_gets_the_same_edge() -> None:
    limits = EdgeLimits(max_header_bytes=2048)
    config = uvicorn.Config(
        create_app(ECHO), http=edge_protocol(limits), **limits.uvicorn_options()
    )
    config.load()
    protocol: Any = config.http_protocol_class
    assert protocol.limits == limits
    assert (config.limit_concurrency, config.timeout_keep_alive) == (1024, 5.0)
    assert config.h11_max_incomplete_event_size == 2048


# -- inlinelm serve ----------------------------------------------------------------------------


def test_inlinelm_serve_caps_heads_and_times_out_silent_connections() -> None:
    command, port = serve_command("--request-timeout-s", "1")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_serving(f"http://127.0.0.1:{port}", process)
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            send(sock, head(extra=f"X-Big: {'a' * 200_000}\r\n"))
            assert read_until_closed(sock, WAIT_S)[:12] in (b"HTTP/1.1 431", b"")
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            assert read_until_closed(sock, SLACK * 1.0) == b""
        assert 1.0 - EARLY_S <= time.monotonic() - start < SLACK * 1.0
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=WAIT_S)
    assert "answered 431" in stderr
