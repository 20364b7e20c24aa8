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

Everything that can be wrong with a request is found before the 200 is sent: the body is
parsed and checked, and the engine validates, tokenizes and admits the request
synchronously in ``Engine.stream``/``Engine.chat``. The router keeps no global state: each
call builds its own endpoints and its own Prometheus registry, so several engines can be
mounted side by side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from inlinelm.api.access import Access, Endpoint
from inlinelm.api.disconnect import finals_unless_disconnected
from inlinelm.api.errors import APIError, bad_request, from_exception
from inlinelm.api.formats import ChatFormat, ChoiceFormat, CompletionFormat
from inlinelm.api.protocol import (
    DEFAULT_MAX_FANOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    ChatRequest,
    Limits,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
    read_body,
    read_json,
)
from inlinelm.api.request_log import log_streamed, log_whole
from inlinelm.api.responses import ResponseHeader, TokenTexts, new_id, usage
from inlinelm.api.sse import (
    EventStreamResponse,
    OutputStream,
    StreamPlan,
    StreamTally,
    TextFrame,
    event_stream,
)
from inlinelm.api.tool_format import ToolChatFormat
from inlinelm.errors import EngineError, QueueFullError, RequestError, RequestFailedError
from inlinelm.sampling_params import SamplingParams
from inlinelm.tools.forced import ForcedCallParser
from inlinelm.tools.parsers import ToolParser, get_parser, parser_for_template
from inlinelm.tools.template import chat_template_text, prepare_messages, template_supports_tools

if TYPE_CHECKING:
    from inlinelm.runtime.engine import Engine

logger = logging.getLogger("inlinelm.api")

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
    The engine is started on the first request if its owner has not started it.
    """
    if max_fanout < 1:
        raise ValueError(f"max_fanout must be at least 1, got {max_fanout}")
    parser = get_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
    api = OpenAIEndpoints(engine, model_name, max_request_bytes, sse_ping_s, max_fanout, parser)
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
            route("/v1/chat/completions", api.chat_completions, "POST"),
            route("/v1/completions", api.completions, "POST"),
            route("/v1/models", api.models, "GET"),
            route("/health", api.health, "GET"),
            route("/metrics", api.metrics, "GET"),
            route("/tokenize", api.tokenize, "POST"),
            route("/detokenize", api.detokenize, "POST"),
        ]
    )


class OpenAIEndpoints:
    """The handlers behind :func:`openai_router`, bound to one engine."""

    def __init__(
        self,
        engine: Engine,
        model_name: str | None,
        max_request_bytes: int,
        sse_ping_s: float,
        max_fanout: int,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.engine = engine
        self.tool_parser = tool_parser
        self.model_name = model_name or engine.model_name
        self.max_request_bytes = max_request_bytes
        self.sse_ping_s = sse_ping_s
        self.max_fanout = max_fanout
        self.registry = CollectorRegistry(auto_describe=True)
        engine.register_metrics(self.registry)
        self._texts: TokenTexts | None = None
        self._chat_template: str | None = None
        self._created = int(time.time())

    # -- generation ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        arrival = time.perf_counter()  # NOTE: before the body is read: TTFT starts here.
        try:
            body = await read_body(request, self.max_request_bytes)
            parsed = parse_chat(parse_json(body), self._limits())
            self._check_model(parsed.model)
            await self._ready()
            rid = new_id("chatcmpl")
            messages, tools = self._chat_inputs(parsed)
            stream = await self._start_chat(messages, tools, parsed.params, rid, arrival, len(body))
        except Exception as exc:
            return _error_response(exc)
        header = ResponseHeader(rid, self.model_name, include_usage=parsed.include_usage)
        fmt = self._chat_format(parsed)
        if parsed.stream:
            return self._stream_response([stream], header, fmt, parsed.params.n, arrival)
        return await self._whole_response(request, [stream], header, fmt, parsed.params.n, arrival)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``; a list of prompts makes one engine request per prompt."""
        arrival = time.perf_counter()  # NOTE: before the body is read: TTFT starts here.
        try:
            body = await read_body(request, self.max_request_bytes)
            parsed = parse_completion(parse_json(body), self._limits())
            self._check_model(parsed.model)
            await self._ready()
            rid = new_id("cmpl")
            streams = await self._start_all(parsed.prompts, parsed.params, rid, arrival, len(body))
            n = parsed.params.n
            prompt_texts = await self._prompt_texts(parsed.prompts, n) if parsed.echo else {}
        except Exception as exc:
            return _error_response(exc)
        header = ResponseHeader(rid, self.model_name, include_usage=parsed.include_usage)
        fmt = CompletionFormat(self.texts(), parsed.logprobs is not None, parsed.echo, prompt_texts)
        if parsed.stream:
            return self._stream_response(streams, header, fmt, n, arrival)
        return await self._whole_response(request, streams, header, fmt, n, arrival)

    def _chat_inputs(
        self, parsed: ChatRequest
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools for the chat template (see :mod:`inlinelm.tools.template`)."""
        offered = parsed.tools.offered if parsed.tools is not None else []
        has_tool_turns = any(m["role"] == "tool" or "tool_calls" in m for m in parsed.messages)
        if not offered and not has_tool_turns:
            return parsed.messages, None
        native = template_supports_tools(self.chat_template())
        messages = prepare_messages(parsed.messages, offered, native=native)
        tools = [t.to_openai() for t in offered] if native and offered else None
        return messages, tools

    def _chat_format(self, parsed: ChatRequest) -> ChoiceFormat:
        """Plain chat choices, or choices read for tool calls when the chat offers tools."""
        tools = parsed.tools
        if tools is None or tools.choice == "none":
            return ChatFormat(self.texts(), parsed.logprobs)
        parser: ToolParser
        if tools.forced:
            parser = ForcedCallParser(tools.tools, tools.named)
        else:
            parser = self.tool_parser or parser_for_template(self.chat_template())
        names = frozenset(tool.name for tool in tools.offered)
        return ToolChatFormat(self.texts(), parsed.logprobs, parser, tools.parallel, names)

    async def _start_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        params: SamplingParams,
        rid: str,
        arrival: float,
        size: int,
    ) -> OutputStream:
        """Hand a chat to the engine; a prompt error names ``messages`` (what the client sent).
        ``size``: the request body's bytes (a large request renders off the loop)."""
        try:
            stream = self.engine.chat(
                messages,
                params,
                request_id=rid,
                arrival_time=arrival,
                tools=tools,
                input_size=size,
            )
            await stream.submit()  # NOTE: a large chat is tokenized off the loop; errors raise here
            return stream
        except RequestError as exc:
            if exc.param != "prompt" or isinstance(exc, QueueFullError):
                raise
            raise bad_request(exc.message, "messages") from exc

    async def _start_all(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        rid: str,
        arrival: float,
        size: int,
    ) -> list[OutputStream]:
        """Hand every prompt to the engine; if one is refused, abort those already started.

        NOTE: each prompt is judged by the whole body's ``size``: many prompts just under
        the inline limit are a large request, tokenized off the loop."""
        streams: list[OutputStream] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                started = self.engine.stream(
                    prompt, params, request_id=request_id, arrival_time=arrival, input_size=size
                )
                streams.append(started)
                await started.submit()  # NOTE: a large prompt's errors raise here, before the 200
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    def _stream_response(
        self,
        streams: list[OutputStream],
        header: ResponseHeader,
        fmt: ChoiceFormat,
        n: int,
        arrival: float,
    ) -> Response:
        tally = StreamTally(arrival)
        text_frame = None
        if isinstance(fmt, ChatFormat) and not fmt.logprobs:
            text_frame = TextFrame.for_chat(header, fmt.chunk_object)
        plan = StreamPlan(
            header,
            fmt,
            n,
            self.engine.metrics,
            tally,
            lambda t: log_streamed(header.id, t),
            text_frame,
        )
        return EventStreamResponse(
            event_stream(streams, plan), ping_s=self.sse_ping_s, streams=streams
        )

    async def _whole_response(
        self,
        request: Request,
        streams: list[OutputStream],
        header: ResponseHeader,
        fmt: ChoiceFormat,
        n: int,
        arrival: float,
    ) -> Response:
        """Wait for every stream's final output, unless the client leaves first (then abort)."""
        try:
            finals = await finals_unless_disconnected(request.receive, streams)
        except Exception as exc:
            return _error_response(exc)
        if finals is None:
            logger.info("request %s: client disconnected, aborted", header.id)
            return Response(status_code=499)
        choices = [
            fmt.whole(i * n + c.index, c) for i, final in enumerate(finals) for c in final.outputs
        ]
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
        log_whole(header.id, finals, arrival)
        body = header.response(
            fmt.response_object, choices, usage(prompt_tokens, completion_tokens)
        )
        return JSONResponse(body)

    # -- the rest --------------------------------------------------------------------------

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
        ok, reason = self._health()
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
            await self._ready()
            tokens = await self.engine.tokenize(
                prompt, messages=messages, add_special_tokens=add_special
            )
        except Exception as exc:
            return _error_response(exc)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: ``{"tokens"}`` → ``{"prompt"}``."""
        try:
            tokens = parse_detokenize(await self._read(request))
            await self._ready()
            if tokens and max(tokens) >= len(self.engine.tokenizer):
                raise bad_request("tokens holds an id outside the vocabulary", "tokens")
            text = await self.engine.detokenize(tokens)
        except Exception as exc:
            return _error_response(exc)
        return JSONResponse({"prompt": text})

    # -- helpers ---------------------------------------------------------------------------

    def texts(self) -> TokenTexts:
        """The token-text cache (made on first use: the tokenizer exists once started)."""
        if self._texts is None:
            self._texts = TokenTexts(self.engine.tokenizer)
        return self._texts

    def chat_template(self) -> str:
        """The model's chat template source (read on first use, like :meth:`texts`)."""
        if self._chat_template is None:
            self._chat_template = chat_template_text(self.engine.tokenizer)
        return self._chat_template

    async def _read(self, request: Request) -> Any:
        return await read_json(request, self.max_request_bytes)

    async def _ready(self) -> None:
        """Start the engine if its owner has not (a 503 when it is closed or dead or stuck)."""
        if not self.engine.is_ready:
            await self.engine.start()
        ok, reason = self._health()
        if not ok:
            raise APIError(
                503,
                f"the engine cannot serve: {reason}",
                type="server_error",
                code="engine_unhealthy",
            )

    def _health(self) -> tuple[bool, str]:
        """``Engine.health`` with a death shown as its error's class only (``dead: RuntimeError``).

        The engine's reason quotes the error's message, which may hold internals (paths,
        device details); clients get the class, the server log has the rest.
        """
        return self.engine.health(detail=False)

    def _limits(self) -> Limits:
        config = self.engine.config
        return Limits(
            max_n=config.max_n, max_logprobs=config.max_logprobs, max_fanout=self.max_fanout
        )

    def _check_model(self, model: str | None) -> None:
        # NOTE: a missing model is the served one (curl users omit it); a wrong one is an error.
        if model is not None and model != self.model_name:
            raise bad_request(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                code="model_not_found",
            )

    async def _prompt_texts(self, prompts: Sequence[str | list[int]], n: int) -> dict[int, str]:
        """Choice index → its prompt as text (for ``echo``); token-id prompts are decoded
        together, off the loop when they are many."""
        ids = [p for p in prompts if not isinstance(p, str)]
        decoded = iter(await self.engine.detokenize_all(ids) if ids else [])
        texts: dict[int, str] = {}
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else next(decoded)
            texts.update({i * n + j: text for j in range(n)})
        return texts


def _error_response(exc: BaseException) -> Response:
    if isinstance(exc, ClientDisconnect):
        # NOTE: no one reads this answer; a client that leaves mid-body is not a server error.
        logger.info("client disconnected while its request body was read")
        return Response(status_code=499)
    error = from_exception(exc)
    if error.status >= 500 and not isinstance(exc, (APIError, EngineError, RequestFailedError)):
        logger.exception("request failed", exc_info=exc)
    return error.response()
