"""Access control: the bearer key, JSON-only bodies, and what a dead engine tells clients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from inlinelm.api import create_app, openai_router
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO, ServerThread, serve
from tests.api.test_errors import check_error

KEY = "sk-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
# (method, path, JSON body) of every endpoint behind the key.
ENDPOINTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
]
CROSS_SITE_TYPES = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    None,
]


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerThread]:
    yield from serve(create_app(ECHO, api_key=KEY))


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x"]
)
def test_a_missing_or_wrong_key_is_a_401(keyed: ServerThread, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path, body in ENDPOINTS:
        response = httpx.request(method, f"{keyed.url}{path}", json=body, headers=headers)
        error = check_error(response, 401, code="invalid_api_key")
        assert error["type"] == "invalid_request_error"
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_every_endpoint_and_health_needs_none(keyed: ServerThread) -> None:
    for method, path, body in ENDPOINTS:
        response = httpx.request(method, f"{keyed.url}{path}", json=body, headers=BEARER)
        assert response.status_code == 200, (path, response.text)
    lower = {"authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert httpx.get(f"{keyed.url}/v1/models", headers=lower).status_code == 200
    assert httpx.get(f"{keyed.url}/health").json() == {"status": "ok"}


def test_the_openai_client_sends_its_api_key(keyed: ServerThread) -> None:
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0) as client:
        reply = client.chat.completions.create(model="default", messages=USER, max_tokens=3)
        assert reply.choices[0].message.content
        assert [m.id for m in client.models.list()] == ["default"]
    with (
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        client.chat.completions.create(model="default", messages=USER)
    assert info.value.code == "invalid_api_key"


@pytest.mark.parametrize("content_type", CROSS_SITE_TYPES)
def test_bodies_a_browser_sends_cross_site_are_415s_with_or_without_a_key(
    keyed: ServerThread, base_url: str, submitted: list[str], content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    body = b'{"prompt": "x", "max_tokens": 2}'
    for url, auth in ((keyed.url, BEARER), (base_url, {})):
        for path in ("/v1/completions", "/tokenize"):
            response = httpx.post(f"{url}{path}", content=body, headers={**headers, **auth})
            check_error(response, 415, code="unsupported_media_type")
    assert submitted == []


def test_json_content_types_are_accepted(base_url: str) -> None:
    body = b'{"prompt": "x", "max_tokens": 2}'
    for content_type in (
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/x+json",
    ):
        response = httpx.post(
            f"{base_url}/v1/completions", content=body, headers={"content-type": content_type}
        )
        assert response.status_code == 200, (content_type, response.text)


def test_an_empty_api_key_is_refused() -> None:
    with pytest.raises(ValueError, match="api_key"):
        openai_router(Engine(ECHO), api_key="")


def test_a_dead_engine_shows_clients_the_error_class_only() -> None:
    app = create_app(ECHO)
    for server in serve(app):

        def boom(batch: Any) -> Any:
            raise RuntimeError("device lost at /secret/path")

        app.state.engine._loaded.core.runner.submit = boom  # the engine thread dies next step
        first = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        health = httpx.get(f"{server.url}/health")
        later = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "stream": True})
        assert check_error(first, 503, code="engine_dead")["message"] == (
            "the engine died: RuntimeError"
        )
        assert health.status_code == 503
        assert health.json() == {"status": "unhealthy", "reason": "dead: RuntimeError"}
        check_error(later, 503)
        for response in (first, health, later):
            assert "secret" not in response.text and "device lost" not in response.text
