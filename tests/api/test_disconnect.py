"""A client that leaves mid-request aborts it: its KV blocks return to the pool within a step."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from inlinelm.api import create_app
from tests.api.conftest import ECHO, ServerThread, serve
from tests.helpers import wait_for

STEP_S = 0.05
LONG = {"prompt": "a long story about", "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def app() -> Any:
    return create_app(ECHO.with_options(echo_step_s=STEP_S))


@pytest.fixture(scope="module")
def server(app: Any) -> Iterator[ServerThread]:
    yield from serve(app)


def test_a_stream_client_that_disconnects_frees_its_blocks_within_a_step(
    app: Any, server: ServerThread
) -> None:
    engine = app.state.engine
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}
        ) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the first chunk: generation runs
        wait_for(lambda: engine.num_free_kv_blocks < engine.num_kv_blocks)
        steps_at_close = engine.stats()["num_steps"]
    # Leaving the block closed the connection without reading the rest of the body.
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)
    assert engine.stats()["num_steps"] - steps_at_close <= 2
    assert engine.stats()["num_running"] == 0


def test_a_waiting_client_that_disconnects_frees_its_blocks(app: Any, server: ServerThread) -> None:
    """A non-streaming client hears nothing until the end; it hangs up once its request runs
    (not after a fixed read timeout, which a loaded machine can outlast before the start)."""
    engine = app.state.engine
    url = urlsplit(server.url)
    body = json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=30) as client:
        client.sendall(head.encode() + body)
        wait_for(lambda: engine.num_free_kv_blocks < engine.num_kv_blocks)  # it runs
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)
    assert engine.stats()["num_running"] == 0
