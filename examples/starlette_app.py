"""An existing Starlette app (its own routes, middleware and lifespan) that mounts the
OpenAI-compatible router under ``/llm`` and calls the engine from one of its own routes.

    python examples/starlette_app.py --port 8000      # or: uvicorn starlette_app:app --app-dir examples

    curl http://127.0.0.1:8000/hello
    curl http://127.0.0.1:8000/haiku?topic=autumn
    curl http://127.0.0.1:8000/llm/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"model": "default", "messages": [{"role": "user", "content": "Hi!"}]}'

``INLINELM_EXAMPLE_RUNNER=echo`` swaps the model for a scripted echo (tokenizer only).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from inlinelm import Engine
from inlinelm.api import openai_router

# inlinelm logs on the "inlinelm" logger and configures no handler; uvicorn configures only
# its own loggers. Without these two lines the model's load (seconds) and the "engine
# ready" line are silent (docs/logging.md).
logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("inlinelm").setLevel(logging.INFO)

engine = Engine(model="default", runner=os.environ.get("INLINELM_EXAMPLE_RUNNER", "model"))


class ServerTiming(BaseHTTPMiddleware):
    """The host's own middleware: it applies to the mounted router's responses too."""

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        response.headers["server-timing"] = f"app;dur={(time.perf_counter() - start) * 1000:.1f}"
        return response


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"hello": "from the host app", "engine_ready": engine.is_ready})


async def haiku(request: Request) -> JSONResponse:
    """The host's own route using the engine directly: no HTTP hop, no OpenAI format."""
    topic = request.query_params.get("topic", "the sea")
    messages = [{"role": "user", "content": f"Write a haiku about {topic}."}]
    out = await engine.chat(messages, temperature=0.7, max_tokens=64)
    return JSONResponse({"topic": topic, "haiku": out.text, "finish_reason": out.finish_reason})


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    # Open the app's other resources here too; the engine loads before the first request.
    async with engine:
        yield


app = Starlette(
    routes=[
        Route("/hello", hello),
        Route("/haiku", haiku),
        Mount("/llm", app=openai_router(engine)),
    ],
    middleware=[Middleware(ServerTiming)],
    lifespan=lifespan,
)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)
