"""``openai_router``: the OpenAI-compatible endpoints of one engine, as a mountable Starlette router.

Endpoints (relative to wherever the router is mounted):

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``)
- ``GET /v1/models``, ``GET /health`` (200, or 503 with the reason), ``GET /metrics``
- ``POST /tokenize``, ``POST /detokenize``

Without ``api_key``, every endpoint but ``/health`` serves only requests whose ``Host`` is a
loopback name or one of ``allowed_hosts`` (a 403 otherwise: DNS rebinding). With
``api_key`` set, every endpoint but ``/health`` wants ``Authorization: Bearer <key>``
(a 401 otherwise). Every POST wants ``Content-Type: application/json``, with or without a
key (a 415 otherwise, also when the type is missing): browsers send cross-site POSTs
without asking only as text/plain, forms or untyped, so none of those reach the engine
(see :mod:`inlinelm.api.access`). What the engine's death shows clients is the error's
class, never its message.

The chat and completion handlers are :mod:`inlinelm.api.serving`'s. The router keeps no
global state: each call builds its own endpoints and its own Prometheus registry, so
several engines can be mounted side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from inlinelm.api.access import Access, Endpoint
from inlinelm.api.body import read_json
from inlinelm.api.errors import bad_request
from inlinelm.api.protocol import (
    DEFAULT_MAX_FANOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    parse_detokenize,
    parse_tokenize,
)
from inlinelm.api.responses_endpoint import ResponsesEndpoint
from inlinelm.api.serving import OpenAIServing, error_response, health_of, ready
from inlinelm.reasoning import ReasoningParser, get_reasoning_parser
from inlinelm.tools.parsers import ToolParser
from inlinelm.tools.registry import get_parser

if TYPE_CHECKING:
    from inlinelm.runtime.engine import Engine

DEFAULT_SSE_PING_S = 15.0


def openai_router(
    engine: Engine,
    *,
    model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    sse_ping_s: float = DEFAULT_SSE_PING_S,
    max_fanout: int = DEFAULT_MAX_FANOUT,
    api_key: str | None = None,
    tool_parser: str | ToolParser | None = None,
    allowed_hosts: Iterable[str] | None = None,
    reasoning_parser: str | ReasoningParser | None = None,
) -> Router:
    """The OpenAI-compatible API of ``engine`` as a router to mount under any prefix.

    ``model_name`` is the id clients must send as ``model`` (default: ``engine.model_name``);
    a request naming another model is a 400. Bodies over ``max_request_bytes`` are a 413.
    A request that would become more than ``max_fanout`` engine requests (prompts × ``n``)
    is a 400, refused before anything is submitted. With ``api_key``, requests must carry
    ``Authorization: Bearer <api_key>`` (``/health`` excepted); POST bodies must always be
    declared ``application/json`` (see the module docstring). ``allowed_hosts``: the
    ``Host`` names served besides loopback ones (``"*"``: every host; ``"*.example.com"``:
    its subdomains); left out, a router without a key serves loopback names only and one
    with a key every host. An app serving the router under its own name passes that name.
    Idle streams get an SSE comment every ``sse_ping_s`` seconds (0 turns pings off).
    ``tool_parser`` reads tool calls out of answers to chats that offer tools with
    ``tool_choice`` "auto": a name in :data:`inlinelm.tools.PARSERS` or a
    :class:`~inlinelm.tools.ToolParser`; None picks one by the model's chat template.
    ``reasoning_parser`` (a name in :data:`inlinelm.reasoning.PARSERS`, or a parser) sends
    a reasoning model's thinking in ``reasoning_content``, apart from its answer; None
    takes the engine's (its ``reasoning_parser`` option, by default the one the model's
    chat template takes: none for a template without ``<think>``, answers whole);
    ``"none"`` leaves every answer whole.
    The engine is started on the first request if its owner has not started it.
    """
    if max_fanout < 1:
        raise ValueError(f"max_fanout must be at least 1, got {max_fanout}")
    parser = get_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
    reasoning: ReasoningParser | None = None
    if isinstance(reasoning_parser, str):
        reasoning = None if reasoning_parser == "none" else get_reasoning_parser(reasoning_parser)
    else:
        reasoning = reasoning_parser
    name = model_name or engine.model_name
    serving = OpenAIServing(
        engine,
        name,
        max_request_bytes,
        sse_ping_s,
        max_fanout,
        parser,
        reasoning,
        reasoning_chosen=reasoning_parser is not None,
    )
    api = OpenAIEndpoints(engine, name, max_request_bytes)
    access = Access(api_key, allowed_hosts)

    def route(path: str, endpoint: Endpoint, method: str) -> Route:
        # NOTE: /health answers probes from anywhere (a pod's IP as Host); it tells nothing.
        public = path == "/health"
        guarded = access.guard(
            endpoint, needs_key=not public, checks_host=not public, json_body=method == "POST"
        )
        return Route(path, guarded, methods=[method])

    return Router(
        routes=[
            route("/v1/chat/completions", serving.chat_completions, "POST"),
            route("/v1/completions", serving.completions, "POST"),
            route("/v1/responses", ResponsesEndpoint(serving).create, "POST"),
            route("/v1/models", api.models, "GET"),
            route("/health", api.health, "GET"),
            route("/metrics", api.metrics, "GET"),
            route("/tokenize", api.tokenize, "POST"),
            route("/detokenize", api.detokenize, "POST"),
        ]
    )


class OpenAIEndpoints:
    """The small endpoints behind :func:`openai_router` (models, health, metrics, tokenize
    and detokenize), bound to one engine."""

    def __init__(self, engine: Engine, model_name: str, max_request_bytes: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.registry = CollectorRegistry(auto_describe=True)
        engine.register_metrics(self.registry)
        self._created = int(time.time())

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the one model this router serves."""
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "inlinelm",
        }
        if self.engine.is_ready:
            card["max_model_len"] = self.engine.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 when the engine serves; 503 with the reason when dead, stuck or closed."""
        ok, reason = health_of(self.engine)
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text from this router's own registry."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` → ``{"count", "max_model_len", "tokens"}``."""
        try:
            prompt, messages, add_special = parse_tokenize(await self._read(request))
            await ready(self.engine)
            tokens = await self.engine.tokenize(
                prompt, messages=messages, add_special_tokens=add_special
            )
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: ``{"tokens"}`` → ``{"prompt"}``."""
        try:
            tokens = parse_detokenize(await self._read(request))
            await ready(self.engine)
            if tokens and max(tokens) >= len(self.engine.tokenizer):
                raise bad_request("tokens holds an id outside the vocabulary", "tokens")
            text = await self.engine.detokenize(tokens)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"prompt": text})

    async def _read(self, request: Request) -> Any:
        return await read_json(request, self.max_request_bytes)
