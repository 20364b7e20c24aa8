"""Access control: the Host a request names (DNS rebinding), the bearer key, JSON-only
bodies, and what a dead engine tells clients."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from starlette.routing import Mount

from inlinelm.api import create_app, openai_router
from inlinelm.api.access import HostCheck, host_name
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO, ServerThread, openai_client, serve
from tests.api.test_errors import check_error
from tests.helpers import core_of

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
    with openai_client(keyed.url, api_key=KEY) as client:
        reply = client.chat.completions.create(model="default", messages=USER, max_tokens=3)
        assert reply.choices[0].message.content
        assert [m.id for m in client.models.list()] == ["default"]
    with (
        openai_client(keyed.url, api_key="wrong") as client,
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

        core_of(app.state.engine).runner.submit = boom  # the engine thread dies next step
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


# -- hosts (DNS rebinding) --------------------------------------------------------------------

EVIL = {"Host": "rebound.example"}


def mounted(**router_options: Any) -> Iterator[ServerThread]:
    """An app of its own with the router mounted at ``/llm`` (and its own lifespan)."""
    engine = Engine(ECHO)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    router = openai_router(engine, **router_options)
    yield from serve(Starlette(routes=[Mount("/llm", app=router)], lifespan=lifespan))


@pytest.fixture(scope="module")
def app_hosts() -> Iterator[ServerThread]:
    yield from mounted(allowed_hosts=["my.app", "*.example.com", "[fd00::1]"])


def test_without_a_key_a_foreign_host_is_a_403_before_any_work(
    base_url: str, submitted: list[str]
) -> None:
    for method, path, body in ENDPOINTS:
        response = httpx.request(method, f"{base_url}{path}", json=body, headers=EVIL)
        error = check_error(response, 403, code="host_not_allowed")
        assert "'rebound.example'" in error["message"] and "--allowed-hosts" in error["message"]
    text_plain = {**EVIL, "content-type": "text/plain"}
    refused = httpx.post(f"{base_url}/v1/completions", content=b"{}", headers=text_plain)
    check_error(refused, 403, code="host_not_allowed")  # the host is checked first
    assert submitted == []
    assert httpx.get(f"{base_url}/health", headers=EVIL).json() == {"status": "ok"}


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:80", "[::1]:8000"],
)
def test_without_a_key_loopback_hosts_are_served_with_any_port(base_url: str, host: str) -> None:
    response = httpx.get(f"{base_url}/v1/models", headers={"Host": host})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "host", ["localhost.rebound.example", "127.0.0.1.rebound.example", "0.0.0.0", "", "[::2]"]
)
def test_names_that_only_look_local_are_refused(base_url: str, host: str) -> None:
    check_error(httpx.get(f"{base_url}/v1/models", headers={"Host": host}), 403)


def test_a_request_without_a_host_header_is_not_a_browsers_and_is_served(base_url: str) -> None:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")  # HTTP/1.0: no Host needed
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_with_a_key_any_host_is_served(keyed: ServerThread) -> None:
    response = httpx.get(f"{keyed.url}/v1/models", headers={**BEARER, **EVIL})
    assert response.status_code == 200, response.text
    check_error(httpx.get(f"{keyed.url}/v1/models", headers=EVIL), 401)


def test_a_mounted_router_without_a_key_serves_loopback_hosts_only() -> None:
    for server in mounted():
        check_error(httpx.get(f"{server.url}/llm/v1/models", headers=EVIL), 403)
        assert httpx.get(f"{server.url}/llm/v1/models").status_code == 200


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("my.app", 200),
        ("MY.APP:8443", 200),
        ("api.example.com", 200),
        ("a.b.example.com", 200),
        ("[fd00::1]:80", 200),
        ("localhost", 200),
        ("example.com", 403),  # "*.example.com" is its subdomains only
        ("my.app.rebound.example", 403),
        ("rebound.example", 403),
    ],
)
def test_an_app_allows_its_own_hosts(app_hosts: ServerThread, host: str, status: int) -> None:
    response = httpx.get(f"{app_hosts.url}/llm/v1/models", headers={"Host": host})
    assert response.status_code == status, response.text


def test_allowed_hosts_star_serves_every_host_and_holds_with_a_key_too() -> None:
    for server in mounted(allowed_hosts=["*"]):
        assert httpx.get(f"{server.url}/llm/v1/models", headers=EVIL).status_code == 200
    for server in mounted(allowed_hosts=["my.app"], api_key=KEY):
        refused = httpx.get(f"{server.url}/llm/v1/models", headers={**EVIL, **BEARER})
        check_error(refused, 403, code="host_not_allowed")
        served = httpx.get(f"{server.url}/llm/v1/models", headers={"Host": "my.app", **BEARER})
        assert served.status_code == 200


def test_create_app_takes_allowed_hosts() -> None:
    for server in serve(create_app(ECHO, allowed_hosts=["my.app"])):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": "my.app"}).status_code == 200
        check_error(httpx.get(f"{server.url}/v1/models", headers=EVIL), 403)


def test_host_names_drop_the_port_and_bracket_ipv6() -> None:
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == host_name("::1") == "[::1]"
    assert host_name("[::1") == ""  # no closing bracket: no name
    check = HostCheck.for_router(False, ["::1", "a.b:80"])
    assert check.allows("a.b") and check.allows("[::1]:1") and not check.allows("b")
    with pytest.raises(ValueError, match="empty host"):
        HostCheck.for_router(False, [""])
