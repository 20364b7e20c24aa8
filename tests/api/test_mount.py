"""The router inside a host app: the host's middleware applies, two engines live side by side."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route

from inlinelm.api import openai_router
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO, ServerThread, openai_client, serve

AUTH = {"Authorization": "Bearer secret"}
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


class RequireToken(BaseHTTPMiddleware):
    """The host's own auth: everything under /llm needs the bearer token."""

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if (
            request.url.path.startswith("/llm")
            and request.headers.get("authorization") != AUTH["Authorization"]
        ):
            return JSONResponse({"detail": "unauthorized"}, status_code=401)
        return await call_next(request)


def host_app(alpha: Engine, beta: Engine) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with alpha, beta:
            yield

    async def hello(request: Request) -> Response:
        return PlainTextResponse("host")

    return Starlette(
        routes=[
            Route("/hello", hello),
            Mount("/llm/alpha", app=openai_router(alpha, model_name="alpha")),
            Mount("/llm/beta", app=openai_router(beta, model_name="beta", max_request_bytes=1000)),
        ],
        middleware=[Middleware(RequireToken)],
        lifespan=lifespan,
    )


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    return Engine(ECHO), Engine(ECHO.with_options(num_kv_blocks=4096))


@pytest.fixture(scope="module")
def server(engines: tuple[Engine, Engine]) -> Iterator[ServerThread]:
    yield from serve(host_app(*engines))


def test_host_routes_and_auth_apply(server: ServerThread) -> None:
    assert httpx.get(f"{server.url}/hello").text == "host"
    assert httpx.get(f"{server.url}/llm/alpha/v1/models").status_code == 401
    assert (
        httpx.get(f"{server.url}/llm/alpha/v1/models", headers=AUTH).json()["data"][0]["id"]
        == "alpha"
    )


def test_two_engines_under_two_prefixes(
    server: ServerThread, engines: tuple[Engine, Engine]
) -> None:
    for name in ("alpha", "beta"):
        with openai_client(f"{server.url}/llm/{name}", api_key="secret") as client:
            reply = client.chat.completions.create(model=name, messages=USER, max_tokens=3)
            assert reply.model == name and reply.choices[0].message.content
            stream = client.completions.create(
                model=name, prompt="one two", max_tokens=2, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == "one two"
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(
                    model="alpha" if name == "beta" else "beta", messages=USER
                )
    assert [e.num_free_kv_blocks for e in engines] == [e.num_kv_blocks for e in engines]


def test_each_router_has_its_own_options_and_metrics(
    server: ServerThread, engines: tuple[Engine, Engine]
) -> None:
    big: dict[str, Any] = {"prompt": "x" * 2000}
    assert (
        httpx.post(f"{server.url}/llm/beta/v1/completions", json=big, headers=AUTH).status_code
        == 413
    )
    assert (
        httpx.post(
            f"{server.url}/llm/alpha/v1/completions", json={**big, "max_tokens": 1}, headers=AUTH
        ).status_code
        == 200
    )
    alpha = httpx.get(f"{server.url}/llm/alpha/metrics", headers=AUTH).text
    beta = httpx.get(f"{server.url}/llm/beta/metrics", headers=AUTH).text
    assert f"inlinelm_kv_blocks_total {float(engines[0].num_kv_blocks)}" in alpha
    assert f"inlinelm_kv_blocks_total {float(engines[1].num_kv_blocks)}" in beta
    assert httpx.get(f"{server.url}/llm/beta/health", headers=AUTH).json() == {"status": "ok"}
