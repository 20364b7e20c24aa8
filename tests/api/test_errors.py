"""Every error path over a real socket: 400, 429, 503, and failures after the 200 (a body
that is not JSON, or past max_request_bytes: test_body.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from inlinelm.api import create_app
from tests.api.conftest import ECHO, ServerThread, serve

USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


def check_error(
    response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The response is an OpenAI error body with exactly its four fields."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return dict(error)


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "temperature": "warm"},
            "temperature",
            "invalid_type",
        ),
        ("/v1/chat/completions", {"messages": USER, "top_p": 2}, "top_p", None),
        ("/v1/chat/completions", {"messages": USER, "n": 5}, "n", None),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "missing_required_parameter",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function"}]},
            "tools[0].function",
            "missing_required_parameter",
        ),
        ("/v1/chat/completions", {"messages": "hi"}, "messages", None),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
        ("/v1/completions", {"prompt": [7] * 9000}, "prompt", None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, "max_tokens", None),
        ("/v1/completions", {"prompt": {"x": 1}}, "prompt", "invalid_type"),
        ("/tokenize", {"prompt": 3}, "prompt", "invalid_type"),
        ("/detokenize", {"tokens": [10**9]}, "tokens", None),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    base_url: str, path: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    for stream in (False, True):
        if stream and not path.startswith("/v1"):
            continue
        check_error(
            httpx.post(f"{base_url}{path}", json={**body, "stream": stream} if stream else body),
            400,
            param=param,
            code=code,
        )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/responses", {"input": "x"}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
    ],
)
def test_a_model_not_served_is_a_404_as_openai_answers_it(
    base_url: str, path: str, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{base_url}{path}", json={**body, "model": "gpt-4o"})
    error = check_error(response, 404, param="model", code="model_not_found")
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "The model `gpt-4o` does not exist; this server serves: default"


def test_a_prompt_longer_than_the_context_is_a_400_before_any_stream(base_url: str) -> None:
    long_chat = [{"role": "user", "content": "word " * 9000}]
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json={"messages": long_chat, "stream": True}, timeout=30
    )
    check_error(response, 400, param="messages")


@pytest.fixture(scope="module")
def tight_server() -> Iterator[ServerThread]:
    """One running slot, a 4-token queue budget and a 300 ms queue deadline."""
    config = ECHO.with_options(
        max_num_seqs=1, max_queued_tokens=4, max_queue_wait_s=0.3, echo_step_s=0.01
    )
    yield from serve(create_app(config))


def test_queue_full_is_a_429_with_retry_after(tight_server: ServerThread) -> None:
    response = httpx.post(
        f"{tight_server.url}/v1/completions",
        json={"prompt": "one two three four five six", "stream": True},
    )
    error = check_error(response, 429, code="queue_full")
    assert error["type"] == "rate_limit_error"
    assert int(response.headers["retry-after"]) >= 1


def test_a_queue_timeout_is_a_503_or_an_error_event_after_the_200(
    tight_server: ServerThread,
) -> None:
    """While one request holds the only slot, the next one times out in the queue."""
    url = tight_server.url
    started = threading.Event()
    hog_body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        connect_sse(client, "POST", f"{url}/v1/completions", json=hog_body) as hog,
    ):
        events = hog.iter_sse()
        next(events)
        next(events)  # the hog runs: it has produced text
        started.set()
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "b"}, timeout=30)
        check_error(response, 503, code="queue_timeout")
        with connect_sse(
            client, "POST", f"{url}/v1/completions", json={"prompt": "c", "stream": True}
        ) as late:
            assert late.response.status_code == 200
            data = [e.data for e in late.iter_sse()]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "queue_timeout"


def test_a_closed_engine_is_a_503() -> None:
    app = create_app(ECHO)
    for server in serve(app):
        app.state.engine.close()
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json() == {
            "status": "unhealthy",
            "reason": "closed",
        }
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER})
        assert check_error(response, 503)["type"] == "server_error"
