"""Requests carried whole to a replica and back (``serve.forward``), without Ray.

A :class:`ForwardingApp` under uvicorn forwards to an in-process "replica" that runs the
real OpenAI router with :func:`serve_forwarded`: the same two halves Ray Serve joins, with
the transport left out, so the wire guarantees can be checked on their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

import httpx
import orjson
import pytest

from inlinelm.api import create_app
from inlinelm.api.errors import APIError
from inlinelm.serve.forward import (
    ForwardedRequest,
    ForwardingApp,
    MessageBatch,
    serve_forwarded,
)
from tests.api.conftest import ECHO, ServerThread, serve
from tests.helpers import wait_for

STEP_S = 0.02
LONG = {"prompt": "a long story about", "max_tokens": 4000, "ignore_eos": True}


class Replica:
    """The replica half: the router's app on forwarded requests, with what it was sent."""

    def __init__(self) -> None:
        self.app = create_app(ECHO.with_options(echo_step_s=STEP_S, max_queued_requests=1))
        self.engine = self.app.state.engine
        self.forwarded: list[ForwardedRequest] = []
        self.fail_after: int | None = None

    async def open_stream(self, request: ForwardedRequest) -> AsyncIterator[MessageBatch]:
        self.forwarded.append(request)
        await self.engine.start()
        sent = 0
        async with aclosing(serve_forwarded(self.app, request)) as batches:
            async for batch in batches:
                if self.fail_after is not None and sent >= self.fail_after:
                    raise ConnectionError("the replica went away")
                sent += 1
                yield batch


def failure(exc: BaseException) -> APIError:
    return APIError(
        503, f"replica failed: {type(exc).__name__}", type="server_error", code="replica_failed"
    )


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    replica = Replica()
    yield replica
    replica.engine.close()


@pytest.fixture(scope="module")
def server(replica: Replica) -> Iterator[ServerThread]:
    yield from serve(ForwardingApp(replica.open_stream, 4096, 64, failure))


@pytest.fixture(autouse=True)
def healthy(replica: Replica) -> None:
    replica.fail_after = None


def test_a_whole_answer_and_its_prefix_key_cross_the_hop(
    replica: Replica, server: ServerThread
) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "S" * 100},
            {"role": "user", "content": "hi there"},
        ]
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]
    sent = replica.forwarded[-1]
    assert sent.method == "POST" and sent.path == "/v1/chat/completions"
    assert sent.prefix_key == "S" * 64  # prefix_chars=64
    assert orjson.loads(sent.body)["max_tokens"] == 3


def test_sse_frames_arrive_while_the_request_still_runs(
    replica: Replica, server: ServerThread
) -> None:
    engine = replica.engine
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        # NOTE: the request would need 4000 steps to finish; a frame now means no buffering
        assert engine.stats()["num_running"] == 1
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)
    assert engine.stats()["num_running"] == 0


def test_a_client_that_leaves_aborts_its_request_on_the_replica(
    replica: Replica, server: ServerThread
) -> None:
    engine = replica.engine
    aborted = engine.stats()["finished"].get("abort", 0)
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}
        ) as response,
    ):
        lines = response.iter_lines()  # NOTE: kept: dropping it would close the connection
        next(lines)
        wait_for(lambda: engine.num_free_kv_blocks < engine.num_kv_blocks)
    wait_for(lambda: engine.stats()["finished"].get("abort", 0) == aborted + 1)
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)


def test_a_bad_request_is_a_400_and_a_large_body_a_413_before_anything_streams(
    replica: Replica, server: ServerThread
) -> None:
    bad = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": -1, "stream": True}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "max_tokens"
    forwarded = len(replica.forwarded)
    large = httpx.post(f"{server.url}/v1/completions", json={"prompt": "y" * 5000})
    assert large.status_code == 413
    assert large.json()["error"]["code"] == "request_too_large"
    assert len(replica.forwarded) == forwarded  # refused at the ingress


def test_headers_cross_the_hop_so_the_replica_still_refuses_a_non_json_post(
    replica: Replica, server: ServerThread
) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": "x"}',
        headers={"content-type": "text/plain"},
    )
    assert response.status_code == 415
    sent = replica.forwarded[-1]
    assert (b"content-type", b"text/plain") in sent.headers


def test_a_full_replica_answers_429_with_retry_after(
    replica: Replica, server: ServerThread
) -> None:
    engine = replica.engine

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            body = {**LONG, "max_tokens": 50, "stream": False}
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(40))
            )

    responses = asyncio.run(main())
    statuses = {r.status_code for r in responses}
    assert statuses == {200, 429}
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)


def test_a_replica_that_fails_mid_stream_ends_it_with_an_error_frame(
    replica: Replica, server: ServerThread
) -> None:
    replica.fail_after = 3
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}
        ) as response,
    ):
        assert response.status_code == 200
        frames = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    error = orjson.loads(frames[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed"
    assert len(frames) >= 3


def test_a_replica_that_fails_before_answering_gives_the_error_as_the_response(
    replica: Replica, server: ServerThread
) -> None:
    replica.fail_after = 0
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "replica_failed"


def test_batching_gathers_a_streams_frames_but_never_holds_its_first_token() -> None:
    async def batches(batch_s: float) -> list[MessageBatch]:
        app = create_app(ECHO.with_options(echo_step_s=0.002))
        body = {"prompt": "count the frames of this echo", "max_tokens": 60, "ignore_eos": True}
        request = ForwardedRequest(
            "POST",
            "/v1/completions",
            headers=((b"content-type", b"application/json"),),
            body=orjson.dumps({**body, "stream": True}),
        )
        async with app.state.engine:
            return [b async for b in serve_forwarded(app.router, request, batch_s)]

    def text_of(result: list[MessageBatch]) -> str:
        body = b"".join(m.get("body", b"") for b in result for m in b)
        frames = [f.removeprefix(b"data: ") for f in body.split(b"\n\n") if f]
        assert frames[-1] == b"[DONE]"
        return "".join(c["text"] for f in frames[:-1] for c in orjson.loads(f)["choices"])

    each_step = asyncio.run(batches(0.0))
    # NOTE: an hour: past the first two, every frame waits for the response's end, which
    # must cut the wait short (else this test times out)
    held = asyncio.run(batches(3600.0))
    assert text_of(held) == text_of(each_step) != ""
    body_batches = [b for b in held if any(m["type"] == "http.response.body" for m in b)]
    assert len(body_batches) <= 3  # the first token, the second, then all the rest at once
    assert len(body_batches[0]) + len(body_batches[1]) <= 4  # not held back behind them
    assert len(each_step) > 10
