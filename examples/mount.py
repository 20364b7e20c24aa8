"""Mount the OpenAI-compatible router inside your own Starlette app, next to your routes.

Run with: ``uvicorn examples.mount:app`` and POST to ``/llm/v1/chat/completions``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from inlinelm import Engine
from inlinelm.api import openai_router

engine = Engine(model="default")


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"hello": "from the host app"})


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with engine:
        yield


app = Starlette(
    routes=[Route("/hello", hello), Mount("/llm", app=openai_router(engine))], lifespan=lifespan
)
