"""A client that leaves mid-request aborts it: its KV blocks return to the pool within a step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from inlinelm.api import create_app
from tests.api.conftest import ECHO, ServerThread, serve

STEP_S = 0.05
LONG = {"prompt": "a long story about", "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def app() -> Any:
    return create_app(ECHO.with_options(echo_step_s=STEP_S))


@pytest.fixture(scope="module")
def server(app: Any) -> Iterator[ServerThread]:
    yield from serve(app)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a real condition until it holds (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


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
    engine = app.state.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.3))
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)
    assert engine.stats()["num_running"] == 0
