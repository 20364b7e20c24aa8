"""The engine's caps on one request over HTTP: past them a 400 naming the field before any
200, streamed or not, and before anything is queued; at them the request is served.

The caps are the engine's alone (``EngineConfig.max_n``, ``max_logprobs``,
``max_stop_strings``, ``max_stop_string_chars``); the router parses the fields and the
engine refuses what is past them, naming a chat's ``top_logprobs`` as the client sent it.
The echo app's engine allows ``n`` up to 4 and the default 20 logprobs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.api.test_errors import USER, check_error
from tests.helpers import WAIT_S
from tests.runtime.helpers import RunnerGate

BODIES = [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), BODIES, ids=["completions", "chat"])
@pytest.mark.parametrize(
    "stop", [[f"stop{i}" for i in range(17)], ["x" * 1025]], ids=["17-stops", "1025-chars"]
)
def test_stop_strings_past_the_caps_are_a_400_naming_stop(
    base_url: str, path: str, body: dict[str, Any], stream: bool, stop: list[str]
) -> None:
    response = httpx.post(
        f"{base_url}{path}", json={**body, "stop": stop, "stream": stream}, timeout=30
    )
    check_error(response, 400, param="stop")


@pytest.mark.parametrize(("path", "body"), BODIES, ids=["completions", "chat"])
def test_stop_strings_at_the_caps_are_served(
    base_url: str, path: str, body: dict[str, Any]
) -> None:
    stop = [f"{i:02d}" + "§" * 1022 for i in range(16)]
    response = httpx.post(
        f"{base_url}{path}", json={**body, "stop": stop, "max_tokens": 4}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


LOGPROBS = {"logprobs": True}
REFUSED = [
    ("/v1/chat/completions", {"messages": USER, "n": 5}, "n", "at most 4"),
    ("/v1/completions", {"prompt": "hi", "n": 5}, "n", "at most 4"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 5}, "n", "at most 4"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "at most 20"),
    (
        "/v1/chat/completions",
        {"messages": USER, **LOGPROBS, "top_logprobs": 21},
        "top_logprobs",
        "at most 20",
    ),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, "n", "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs", "logprobs"),
    (
        "/v1/chat/completions",
        {"messages": USER, **LOGPROBS, "top_logprobs": -1},
        "top_logprobs",
        "logprobs",
    ),
]
IDS = [
    "chat-n",
    "completion-n",
    "prompts-n",
    "completion-logprobs",
    "chat-top-logprobs",
    "chat-n-0",
    "completion-logprobs-negative",
    "chat-top-logprobs-negative",
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "param", "fragment"), REFUSED, ids=IDS)
def test_n_and_logprobs_out_of_range_are_a_400_naming_the_field_before_anything_is_queued(
    base_url: str,
    queued: list[str],
    path: str,
    body: dict[str, Any],
    param: str,
    fragment: str,
    stream: bool,
) -> None:
    response = httpx.post(f"{base_url}{path}", json={**body, "stream": stream}, timeout=30)
    assert fragment in check_error(response, 400, param=param)["message"]
    assert queued == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER, "n": 4, **LOGPROBS, "top_logprobs": 20}),
        ("/v1/completions", {"prompt": "hi", "n": 4, "logprobs": 20}),
    ],
    ids=["chat", "completions"],
)
def test_n_and_logprobs_at_the_caps_are_served(
    base_url: str, path: str, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{base_url}{path}", json={**body, "max_tokens": 2}, timeout=30)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 4


def test_a_refused_request_leaves_the_requests_in_flight_alone(
    echo_app: Any, base_url: str, queued: list[str]
) -> None:
    body = {"prompt": "a b c", "max_tokens": 8, "ignore_eos": True}
    url = f"{base_url}/v1/completions"
    with RunnerGate(echo_app.state.engine) as gate, ThreadPoolExecutor(1) as pool:
        gate.close()
        in_flight = pool.submit(httpx.post, url, json=body, timeout=30)
        assert gate.entered.wait(WAIT_S), "the request in flight never reached a step"
        for path, refused, param, _ in REFUSED:
            check_error(httpx.post(f"{base_url}{path}", json=refused, timeout=30), 400, param=param)
        assert len(queued) == 1  # the one in flight, blocked in its step
        gate.open()
        answer = in_flight.result(WAIT_S).json()
    alone = httpx.post(url, json=body, timeout=30).json()
    assert answer["choices"] == alone["choices"] and answer["usage"] == alone["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
