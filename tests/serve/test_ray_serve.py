"""inlinelm on Ray Serve: two echo-engine replicas behind the prefix-routing ingress.

One local Ray instance (``ray.init(num_cpus=2)``, loopback only) and one Serve app serve
the whole module; the test that kills a replica runs last. The tests that need a
deployment of their own (a full one, Serve's own routing, a faulty replica, autoscaling)
each get an app under its own route prefix, deployed with the main one: Serve starts all
their replicas at once (one after another, each took ~10 s). Each replica reports what it
holds through ``record_routing_stats``, called here on its actor, and every forwarded
response names its replica in ``x-inlinelm-replica``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from inlinelm.config import EngineConfig
from inlinelm.serve.ray import ApiOptions, build_app
from tests import helpers
from tests.api.conftest import openai_client
from tests.helpers import wait_for
from tests.serve import faulty_replica
from tests.serve.ray_import import RAY_MARKS, ray, serve

pytestmark = [*RAY_MARKS, pytest.mark.timeout(600)]

APP = "llm"
STEP_S = 0.01
ECHO = EngineConfig(
    model="default", runner="echo", num_threads=1, max_num_seqs=64, echo_step_s=STEP_S
)
MAX_BYTES = 1 << 20
SYSTEM = "You are the shared assistant of this test; keep every answer short. " * 8
LONG = {"prompt": "a long story about", "max_tokens": 4000, "ignore_eos": True}
WAIT_S = 60.0
POLL_S = 0.05
"""How often a wait looks again: each look asks every replica actor for its stats."""
SIDE_CPUS = 0.1
"""Each side app's replica: with the main app's 2 x 0.5 they fit num_cpus=2, with room for
the replica the autoscaler adds and the one that replaces a failed replica."""
FULL = EngineConfig(
    model="default",
    runner="echo",
    num_threads=1,
    max_num_seqs=2,
    max_queued_requests=2,
    echo_step_s=0.02,
)
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 4,
    "upscale_delay_s": 0,
    "look_back_period_s": 1,
    "metrics_interval_s": 0.5,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            ECHO,
            num_replicas=2,
            ray_actor_options={"num_cpus": 0.5},
            health_check_period_s=1.0,
            api=ApiOptions(max_request_bytes=MAX_BYTES),
        )
        serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/"), *side_apps()])
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def side_apps() -> list[serve.RunTarget]:
    """The apps of the tests that need a deployment of their own, each named for its
    route prefix."""
    # NOTE: workers lack tests/: the replica class and the helpers it calls go by value
    ray.cloudpickle.register_pickle_by_value(faulty_replica)
    ray.cloudpickle.register_pickle_by_value(helpers)
    side = {"num_cpus": SIDE_CPUS}
    apps = {
        "full": build_app(FULL, num_replicas=1, ray_actor_options=side),
        # routing="serve": no ingress, Serve's ASGI integration straight to the router
        "direct": build_app(ECHO, routing="serve", ray_actor_options=side),
        "faulty": build_app(
            ECHO,
            ray_actor_options=side,
            health_check_period_s=0.5,
            replica_class=faulty_replica.FaultyReplica,
        ),
        "auto": build_app(ECHO, ray_actor_options=side, autoscaling_config=AUTOSCALING),
    }
    return [serve.RunTarget(app, name=name, route_prefix=f"/{name}") for name, app in apps.items()]


def replica_stats(app: str = APP) -> dict[str, dict[str, Any]]:
    """Each live engine replica's ``record_routing_stats``, by replica id."""
    prefix = f"SERVE_REPLICA::{app}#InlineLMReplica#"
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefix)
    ]
    stats = {}
    for name in names:
        try:
            actor = ray.get_actor(name, namespace="serve")
            one = ray.get(actor.record_routing_stats.remote(), timeout=WAIT_S)
        except (ValueError, ray.exceptions.RayError):
            continue  # NOTE: a replica that is stopping (or gone) holds nothing
        stats[one["replica_id"]] = one
    return stats


def running_replicas(app: str = APP) -> int:
    """The engine replicas Serve reports running (``InlineLMReplica``)."""
    status = serve.status().applications[app].deployments["InlineLMReplica"]
    return int(status.replica_states.get("RUNNING", 0))


def sse_texts(lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The streamed text of a completion, and its data payloads."""
    payloads = [
        orjson.loads(line.removeprefix("data: "))
        for line in lines
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    text = "".join(c["text"] for p in payloads for c in p.get("choices", []))
    return text, payloads


def test_the_openai_sdk_streams_through_the_serve_app(url: str) -> None:
    with openai_client(url) as client:
        stream = client.completions.create(
            model="default", prompt="Hello from Ray Serve", max_tokens=50, stream=True
        )
        chunks = list(stream)
        chat = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=8,
            stream=True,
        )
        deltas = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == "Hello from Ray Serve"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(chunks) > 2  # token by token, not one buffered blob
    assert "".join(deltas).startswith("system\nYou are")


def test_200_concurrent_streams_spread_over_both_replicas_and_all_complete(url: str) -> None:
    prompts = [f"stream number {i} of two hundred" for i in range(200)]

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        body = {"prompt": prompt, "max_tokens": 64, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        text, _ = sse_texts(lines)
        assert lines[-1] == "data: [DONE]"
        return text, response.headers["x-inlinelm-replica"]

    async def main() -> list[tuple[str, str]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert [text for text, _ in results] == prompts
    spread = Counter(replica for _, replica in results)
    assert set(spread) == set(replica_stats())
    assert min(spread.values()) >= 40  # distinct prompts hash apart (binomial, p=1/2)


def test_chats_sharing_a_system_prompt_are_served_by_one_replica(url: str) -> None:
    before = replica_stats()
    replicas = []
    with httpx.Client(base_url=url, timeout=WAIT_S) as client:
        for i in range(12):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"},
            ]
            # NOTE: routing and the prefix cache see only the prompt; 4 tokens, not the
            # whole ~150-token echo at 10 ms a step
            body = {"messages": messages, "max_tokens": 4}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            replicas.append(response.headers["x-inlinelm-replica"])
    assert len(set(replicas)) == 1
    after = replica_stats()
    served = replicas[0]
    hits = after[served]["prefix_cache_hit_tokens"] - before[served]["prefix_cache_hit_tokens"]
    assert hits >= 11 * 16  # every chat after the first found the system prompt cached


def test_a_disconnect_aborts_the_request_and_frees_its_blocks_on_its_replica(url: str) -> None:
    with (
        httpx.Client(base_url=url, timeout=WAIT_S) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
    ):
        lines = response.iter_lines()  # NOTE: kept: dropping it would close the connection
        assert next(lines).startswith("data: ")
        served = response.headers["x-inlinelm-replica"]
        stats = replica_stats()[served]
        # NOTE: 4000 steps from done: a frame now means SSE is not buffered on the way
        assert stats["running"] == 1 and stats["kv_blocks_used"] > 0
        aborted = stats["finished"].get("abort", 0)
    wait_for(
        lambda: replica_stats()[served]["finished"].get("abort", 0) == aborted + 1,
        WAIT_S,
        poll_s=POLL_S,
        what="the abort",
    )
    wait_for(lambda: replica_stats()[served]["kv_blocks_used"] == 0, WAIT_S, poll_s=POLL_S)


def test_bad_input_is_a_4xx_before_any_200(url: str) -> None:
    with httpx.Client(base_url=url, timeout=WAIT_S) as client:
        bad = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 0},
        )
        large = client.post("/v1/completions", json={"prompt": "y" * MAX_BYTES})
        not_json = client.post(
            "/v1/completions", content=b"{", headers={"content-type": "application/json"}
        )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large"
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


def test_a_full_deployment_answers_429_with_retry_after(url: str) -> None:
    """The ``full`` app: one replica of ``FULL`` (2 running, 2 queued)."""

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=f"{url}/full", timeout=WAIT_S) as client:
            body = {"prompt": "busy", "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(30))
            )

    responses = asyncio.run(main())
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"


def test_the_engine_deployment_serves_http_behind_serves_own_proxy(url: str) -> None:
    """The ``direct`` app, ``routing="serve"``: no ingress, Serve's ASGI integration
    straight to the router."""
    with httpx.Client(base_url=f"{url}/direct", timeout=WAIT_S) as client:
        body = {"prompt": "straight through", "max_tokens": 50, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        health = client.get("/health")
        metrics = client.get("/metrics")
        bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
    text, payloads = sse_texts(lines)
    assert text == "straight through" and len(payloads) > 2 and lines[-1] == "data: [DONE]"
    assert health.json() == {"status": "ok"}
    assert "inlinelm_prefix_cache_hit_rate" in metrics.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_replica_whose_engine_dies_fails_its_health_check_and_serve_replaces_it(
    url: str,
) -> None:
    """The ``faulty`` app: one :class:`FaultyReplica`, health-checked every 0.5 s."""
    handle = serve.get_deployment_handle("InlineLMReplica", app_name="faulty")
    victim = handle.break_engine.remote().result(timeout_s=WAIT_S)
    body = {"prompt": "the last request", "max_tokens": 5}
    failed = httpx.post(f"{url}/faulty/v1/completions", json=body, timeout=WAIT_S)
    wait_for(
        lambda: running_replicas("faulty") == 1 and victim not in replica_stats("faulty"),
        WAIT_S,
        poll_s=POLL_S,
        what="a new faulty replica",
    )
    served = httpx.post(f"{url}/faulty/v1/completions", json=body, timeout=WAIT_S)
    assert failed.status_code >= 500 and failed.json()["error"]["code"] == "engine_dead"
    assert served.status_code == 200
    assert served.json()["choices"][0]["text"] == "the last request"
    assert served.headers["x-inlinelm-replica"] != victim


def test_the_deployment_scales_out_on_its_engines_load(url: str) -> None:
    """The ``auto`` app: ``AUTOSCALING`` from one replica to two."""

    async def main() -> None:
        async with httpx.AsyncClient(base_url=f"{url}/auto", timeout=WAIT_S) as client:
            body = {"prompt": "keep busy", "max_tokens": 4000, "ignore_eos": True}
            load = [
                asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(16)
            ]
            try:
                deadline = time.monotonic() + WAIT_S
                while running_replicas("auto") < 2:
                    assert time.monotonic() < deadline, "the deployment did not scale out"
                    await asyncio.sleep(0.1)
            finally:
                for request in load:
                    request.cancel()
                await asyncio.gather(*load, return_exceptions=True)

    assert running_replicas("auto") == 1
    asyncio.run(main())


def test_killing_a_replica_fails_only_its_streams_and_serve_brings_it_back(url: str) -> None:
    """Runs last: it changes the replica set."""
    prompts = [f"survivor check {i}" for i in range(40)]
    started = asyncio.Event()

    async def one(client: httpx.AsyncClient, prompt: str, ready: list[str]) -> tuple[str, str]:
        body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                if not lines:
                    ready.append(prompt)
                    if len(ready) == len(prompts):
                        started.set()
                lines.append(line)
        return response.headers["x-inlinelm-replica"], "\n".join(lines)

    async def main() -> tuple[str, list[tuple[str, str]]]:
        ready: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            tasks = [asyncio.ensure_future(one(client, p, ready)) for p in prompts]
            await asyncio.wait_for(started.wait(), WAIT_S)
            victim = sorted(replica_stats())[0]
            actor = ray.get_actor(f"SERVE_REPLICA::{APP}#InlineLMReplica#{victim}", "serve")
            ray.kill(actor, no_restart=True)
            return victim, await asyncio.gather(*tasks)

    victim, results = asyncio.run(main())
    failed = [body for replica, body in results if replica == victim]
    survived = [body for replica, body in results if replica != victim]
    assert failed and survived
    for body in failed:
        lines = body.split("\n")
        assert lines[-1] == "data: [DONE]"
        error = orjson.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "replica_failed"
    for body in survived:
        _, payloads = sse_texts(body.split("\n"))
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        assert "error" not in body
    wait_for(
        lambda: running_replicas() == 2 and victim not in replica_stats(),
        WAIT_S,
        poll_s=POLL_S,
        what="a replica in place of the killed one",
    )
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "back", "max_tokens": 4})
    assert response.status_code == 200
