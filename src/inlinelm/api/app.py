"""``create_app``: a ready-to-serve Starlette app around one engine, or several engines each
served under its model name."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Literal, TypedDict

from starlette.applications import Starlette

from inlinelm.api.page import chat_page_route
from inlinelm.api.protocol import DEFAULT_MAX_FANOUT, DEFAULT_MAX_REQUEST_BYTES
from inlinelm.api.router import DEFAULT_SSE_PING_S, openai_router, served_engines
from inlinelm.config import EngineConfig
from inlinelm.reasoning import ReasoningParser
from inlinelm.runtime.engine import Engine
from inlinelm.tools.parsers import ToolParser

logger = logging.getLogger("inlinelm.api")


class UvicornOptions(TypedDict):
    """The event loop and HTTP parser to pass to ``uvicorn.run`` / ``uvicorn.Config``."""

    loop: Literal["uvloop", "asyncio"]
    http: Literal["httptools", "h11"]


def create_app(
    engine_or_config: Engine | EngineConfig | Mapping[str, Engine | EngineConfig],
    *,
    model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    sse_ping_s: float = DEFAULT_SSE_PING_S,
    max_fanout: int = DEFAULT_MAX_FANOUT,
    api_key: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
    tool_parser: str | ToolParser | None = None,
    reasoning_parser: str | ReasoningParser | None = None,
) -> Starlette:
    """A Starlette app serving the OpenAI-compatible API at its root, and a chat page at ``/``.

    Given an ``EngineConfig``, the app makes the engine; given an ``Engine``, it takes it
    over. Given a mapping of model names to either, it serves each under its name (a
    request's ``model`` picks one: :func:`~inlinelm.api.openai_router`). The app's
    lifespan starts every engine (one after the other, in order) before the first request,
    and closes every one on shutdown; if one fails to start, all are closed and its error
    raised. The
    engines are ``app.state.engines`` (name → engine); a single engine is also
    ``app.state.engine``. The keyword options are :func:`~inlinelm.api.openai_router`'s
    (``model_name`` only for a single engine).

    The event loop and HTTP parser are the server's choice. ``inlinelm serve`` runs uvloop
    and httptools (both come with inlinelm, through ``uvicorn[standard]``): with 256
    streaming clients they cut the loop's lag behind the engine several times over
    (``benchmarks/README.md``). Under your own server, get the same with
    ``uvicorn.run(app, loop="uvloop", http="httptools")``, ``uvicorn --loop uvloop --http
    httptools module:app`` (uvicorn's ``auto`` picks both when installed), or
    ``hypercorn --worker-class uvloop module:app`` (hypercorn parses HTTP with h11). Mounted
    in an app that already runs, the engine uses the running loop, asyncio's or uvloop's.
    The limits ``inlinelm serve`` holds clients to (a capped request head, a deadline for
    a request to arrive, idle and connection bounds) are :mod:`inlinelm.api.edge`'s: pass
    ``http=edge_protocol(limits), **limits.uvicorn_options()`` to uvicorn for the same.
    """
    served: Engine | dict[str, Engine]
    if isinstance(engine_or_config, Mapping):
        served = {name: _engine(e) for name, e in engine_or_config.items()}
    else:
        served = _engine(engine_or_config)
    engines = served_engines(served, model_name)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await start_all(engines.values())
            yield
        finally:
            await close_all(engines.values())

    router = openai_router(
        served,
        model_name=model_name,
        max_request_bytes=max_request_bytes,
        sse_ping_s=sse_ping_s,
        max_fanout=max_fanout,
        api_key=api_key,
        allowed_hosts=allowed_hosts,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    app = Starlette(routes=[chat_page_route(), *router.routes], lifespan=lifespan)
    app.state.engines = engines
    if isinstance(served, Engine):
        app.state.engine = served
    return app


async def start_all(engines: Iterable[Engine]) -> None:
    """Start every engine, one after the other, in order; the first failure is raised and
    the engines after it are left unstarted (closing them is the caller's, as for the rest).

    NOTE: one at a time: two engines loading at once in a fresh process race in
    transformers' lazy imports (``cannot import name 'AutoTokenizer'``, seen), and on a CPU
    two loads share one memory bandwidth anyway.
    """
    for engine in engines:
        await engine.start()


async def close_all(engines: Iterable[Engine]) -> None:
    """Close every engine at once (each one whatever the others do); the first failure,
    if any, is raised once all are closed."""
    results = await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _engine(engine_or_config: Engine | EngineConfig) -> Engine:
    return engine_or_config if isinstance(engine_or_config, Engine) else Engine(engine_or_config)


def uvicorn_options() -> UvicornOptions:
    """uvicorn's ``loop`` and ``http`` for ``inlinelm serve``: ``uvloop`` and ``httptools``.

    Either one that does not import falls back to uvicorn's pure-Python choice
    (``asyncio``, ``h11``), with a warning: the server works, only slower under load.
    """
    return {
        "loop": "uvloop" if _imports("uvloop", "loop=asyncio") else "asyncio",
        "http": "httptools" if _imports("httptools", "http=h11") else "h11",
    }


def _imports(module: str, fallback: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        logger.warning(
            "%s does not import; serving with uvicorn's %s, slower with many streams "
            "(pip install 'uvicorn[standard]')",
            module,
            fallback,
        )
        return False
    return True
