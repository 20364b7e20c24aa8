"""``openai_router``: the OpenAI-compatible endpoints of one engine, or of several engines
each served under its model name, as a mountable Starlette router.

Endpoints (relative to wherever the router is mounted):

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
  ``POST /v1/responses``
- ``GET /v1/models``, ``GET /health`` (200, or 503 with the reason), ``GET /metrics``
- ``POST /tokenize``, ``POST /detokenize``

Every POST goes to the model its body's ``model`` names (:mod:`inlinelm.api.model_table`:
the body is read once there; a model not served is a 404 ``model_not_found``; with several
models, a body naming none is a 400). ``/v1/models`` lists every model, ``/health`` is ok
when every engine serves, and ``/metrics`` holds every engine's metrics, labelled
``model_name`` when there are several (:mod:`inlinelm.api.model_metrics`).

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
several routers can be mounted side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from inlinelm.api.access import Access, Endpoint
from inlinelm.api.body import JsonBody
from inlinelm.api.errors import bad_request
from inlinelm.api.model_metrics import metrics_registry
from inlinelm.api.model_table import BodyHandler, ModelTable
from inlinelm.api.pooling_endpoints import PoolingEndpoints
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
    from collections.abc import Callable

    from inlinelm.runtime.engine import Engine

DEFAULT_SSE_PING_S = 15.0


def openai_router(
    engines: Engine | Mapping[str, Engine],
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
    """The OpenAI-compatible API of ``engines`` as a router to mount under any prefix.

    ``engines`` is one engine, or a mapping of model names to engines (a chat model, an
    embedder, ...): a request's ``model`` picks its engine; a name not served is a 404
    ``model_not_found``, and with several engines a request naming none is a 400.
    ``model_name`` is the id of a single engine (default: ``engine.model_name``); a
    mapping names its own. Bodies over ``max_request_bytes`` are a 413.
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
    :class:`~inlinelm.tools.ToolParser`; None picks one by each model's chat template.
    ``reasoning_parser`` (a name in :data:`inlinelm.reasoning.PARSERS`, or a parser) sends
    a reasoning model's thinking in ``reasoning_content``, apart from its answer; None
    takes each engine's (its ``reasoning_parser`` option, by default the one the model's
    chat template takes: none for a template without ``<think>``, answers whole);
    ``"none"`` leaves every answer whole. Both parsers apply to every engine.
    Each engine is started on its first request if its owner has not started it.
    """
    if max_fanout < 1:
        raise ValueError(f"max_fanout must be at least 1, got {max_fanout}")
    parser = get_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
    reasoning: ReasoningParser | None = None
    if isinstance(reasoning_parser, str):
        reasoning = None if reasoning_parser == "none" else get_reasoning_parser(reasoning_parser)
    else:
        reasoning = reasoning_parser
    servings = {
        name: OpenAIServing(
            engine,
            name,
            max_request_bytes,
            sse_ping_s,
            max_fanout,
            parser,
            reasoning,
            reasoning_chosen=reasoning_parser is not None,
        )
        for name, engine in served_engines(engines, model_name).items()
    }
    return _routes(ModelTable(servings, max_request_bytes), Access(api_key, allowed_hosts))


def _routes(table: ModelTable, access: Access) -> Router:
    """Every endpoint of ``table``'s models behind ``access``: the POSTs dispatched by
    ``model`` (one line each), the GETs about every model."""
    server = ServerEndpoints(table)

    def route(path: str, endpoint: Endpoint, method: str) -> Route:
        # NOTE: /health answers probes from anywhere (a pod's IP as Host); it tells nothing.
        public = path == "/health"
        guarded = access.guard(
            endpoint, needs_key=not public, checks_host=not public, json_body=method == "POST"
        )
        return Route(path, guarded, methods=[method])

    def post(path: str, make: Callable[[OpenAIServing], BodyHandler]) -> Route:
        return route(path, table.dispatch(make), "POST")

    return Router(
        routes=[
            post("/v1/chat/completions", lambda serving: serving.chat_completions),
            post("/v1/completions", lambda serving: serving.completions),
            post("/v1/responses", lambda serving: ResponsesEndpoint(serving).create),
            post("/v1/embeddings", lambda serving: PoolingEndpoints(serving).embeddings),
            post("/v1/rerank", lambda serving: PoolingEndpoints(serving).rerank),
            post("/v1/score", lambda serving: PoolingEndpoints(serving).score),
            route("/v1/models", server.models, "GET"),
            route("/health", server.health, "GET"),
            route("/metrics", server.metrics, "GET"),
            post("/tokenize", lambda serving: TokenizerEndpoints(serving.engine).tokenize),
            post("/detokenize", lambda serving: TokenizerEndpoints(serving.engine).detokenize),
        ]
    )


def served_engines(
    engines: Engine | Mapping[str, Engine], model_name: str | None = None
) -> dict[str, Engine]:
    """``engines`` by the name each is served as: one engine as ``model_name`` (default:
    its own ``model_name``), a mapping as it is. ``ValueError`` for an empty mapping, an
    empty name, or a ``model_name`` next to a mapping (which names its engines itself)."""
    if not isinstance(engines, Mapping):
        return {model_name or engines.model_name: engines}
    if model_name is not None:
        raise ValueError("model_name names a single engine; a mapping's keys name its engines")
    if not engines:
        raise ValueError("no engine to serve: the mapping is empty")
    for name in engines:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a model name must be a non-empty string, got {name!r}")
    return dict(engines)


class ServerEndpoints:
    """The endpoints about every served model: ``/v1/models``, ``/health``, ``/metrics``."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table
        self.registry = metrics_registry({n: s.engine for n, s in table.models.items()})
        self._created = int(time.time())

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: every model this router serves (with its ``max_model_len``
        once its engine is ready)."""
        cards = [self._card(name, s.engine) for name, s in self.table.models.items()]
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 when every engine serves; 503 with the reason when one is
        dead, stuck or closed (with several engines, the reason names each such model)."""
        checks = {name: health_of(s.engine) for name, s in self.table.models.items()}
        failing = {name: reason for name, (ok, reason) in checks.items() if not ok}
        if not failing:
            return JSONResponse({"status": "ok"})
        if len(checks) == 1:
            (reason,) = failing.values()
        else:
            reason = "; ".join(f"{name}: {why}" for name, why in failing.items())
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text from this router's own registry."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def _card(self, name: str, engine: Engine) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "inlinelm",
        }
        if engine.is_ready:
            card["max_model_len"] = engine.max_model_len
        return card


class TokenizerEndpoints:
    """``/tokenize`` and ``/detokenize`` of one engine (each given the parsed body)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def tokenize(self, request: Request, body: JsonBody) -> Response:
        """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` → ``{"count", "max_model_len", "tokens"}``."""
        try:
            prompt, messages, add_special = parse_tokenize(body.data)
            await ready(self.engine)
            tokens = await self.engine.tokenize(
                prompt, messages=messages, add_special_tokens=add_special
            )
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: Request, body: JsonBody) -> Response:
        """``POST /detokenize``: ``{"tokens"}`` → ``{"prompt"}``."""
        try:
            tokens = parse_detokenize(body.data)
            await ready(self.engine)
            if tokens and max(tokens) >= len(self.engine.tokenizer):
                raise bad_request("tokens holds an id outside the vocabulary", "tokens")
            text = await self.engine.detokenize(tokens)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"prompt": text})
