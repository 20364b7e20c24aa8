"""``create_app``: a ready-to-serve Starlette app around one engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette

from inlinelm.api.page import chat_page_route
from inlinelm.api.protocol import DEFAULT_MAX_FANOUT, DEFAULT_MAX_REQUEST_BYTES
from inlinelm.api.router import DEFAULT_SSE_PING_S, openai_router
from inlinelm.config import EngineConfig
from inlinelm.runtime.engine import Engine


def create_app(
    engine_or_config: Engine | EngineConfig,
    *,
    model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    sse_ping_s: float = DEFAULT_SSE_PING_S,
    max_fanout: int = DEFAULT_MAX_FANOUT,
    api_key: str | None = None,
) -> Starlette:
    """A Starlette app serving the OpenAI-compatible API at its root, and a chat page at ``/``.

    Given an ``EngineConfig``, the app makes the engine; given an ``Engine``, it takes it
    over. Either way the app's lifespan starts the engine before the first request and
    closes it on shutdown; the engine is ``app.state.engine``. The keyword options are
    :func:`~inlinelm.api.openai_router`'s.
    """
    engine = engine_or_config if isinstance(engine_or_config, Engine) else Engine(engine_or_config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.aclose()

    router = openai_router(
        engine,
        model_name=model_name,
        max_request_bytes=max_request_bytes,
        sse_ping_s=sse_ping_s,
        max_fanout=max_fanout,
        api_key=api_key,
    )
    app = Starlette(routes=[chat_page_route(), *router.routes], lifespan=lifespan)
    app.state.engine = engine
    return app
