"""The generation endpoints, ``POST /v1/chat/completions`` and ``POST /v1/completions``
(vLLM's serving_chat.py and serving_completion.py), bound to one engine.

Everything that can be wrong with a request is found before the 200 is sent: the body is
parsed and checked, and the engine validates, tokenizes and admits the request
synchronously in ``Engine.stream``/``Engine.chat``; the body comes read, and matched to
this model, by the router's dispatch (:mod:`inlinelm.api.model_table`). An answer is a
stream of SSE chunks (``stream``) or one JSON body; a client that leaves either way aborts
its requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from inlinelm.api.disconnect import finals_unless_disconnected
from inlinelm.api.errors import APIError, bad_request, from_exception
from inlinelm.api.formats import ChatFormat, ChoiceFormat, CompletionFormat
from inlinelm.api.protocol import (
    CHAT_PARAMS,
    ChatRequest,
    Limits,
    parse_chat,
    parse_completion,
)
from inlinelm.api.reasoning_format import ReasoningChatFormat
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
from inlinelm.api.tool_format import ToolPolicy
from inlinelm.errors import EngineError, QueueFullError, RequestError, RequestFailedError
from inlinelm.reasoning import ReasoningParser
from inlinelm.runtime.prompt_source import Prompt
from inlinelm.sampling_params import SamplingParams
from inlinelm.tools.parsers import ToolParser
from inlinelm.tools.template import chat_template_text

if TYPE_CHECKING:
    from inlinelm.api.body import JsonBody
    from inlinelm.runtime.engine import Engine

logger = logging.getLogger("inlinelm.api")


class OpenAIServing:
    """The chat and completion handlers of one served model behind
    :func:`~inlinelm.api.openai_router`.

    ``model_name``: the id the model is served as (answers name it; the router's dispatch
    has matched each body's ``model`` to it). ``max_request_bytes`` bounds a body,
    ``max_fanout`` the engine requests one body becomes (prompts × ``n``); idle streams
    get an SSE comment every ``sse_ping_s`` seconds; ``reasoning_parser`` splits a
    reasoning model's chat answers (:mod:`inlinelm.api.reasoning_format`; None: the
    engine's, unless ``reasoning_chosen``, which makes None mean none); ``tool_parser``
    reads tool calls out of chats with ``tool_choice`` "auto" (None: the chat template's
    own).
    """

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        max_request_bytes: int,
        sse_ping_s: float,
        max_fanout: int,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        *,
        reasoning_chosen: bool = False,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.sse_ping_s = sse_ping_s
        self.limits = Limits(max_fanout=max_fanout)
        self.tools = ToolPolicy(tool_parser, self.chat_template)
        self._reasoning = reasoning_parser
        self._reasoning_chosen = reasoning_parser is not None or reasoning_chosen
        self._texts: TokenTexts | None = None
        self._chat_template: str | None = None

    async def chat_completions(self, request: Request, body: JsonBody) -> Response:
        """``POST /v1/chat/completions`` of the parsed ``body``."""
        arrival = body.arrival
        try:
            rid = new_id("chatcmpl")
            parsed, stream = await self.open_chat(body.data, rid, arrival, body.size)
        except Exception as exc:
            return error_response(exc)
        header = ResponseHeader(rid, self.model_name, include_usage=parsed.include_usage)
        fmt = self.chat_format(parsed)
        if parsed.stream:
            return self._stream_response([stream], header, fmt, parsed.params.n, arrival)
        return await self._whole_response(request, [stream], header, fmt, parsed.params.n, arrival)

    async def open_chat(
        self, data: Any, rid: str, arrival: float, size: int
    ) -> tuple[ChatRequest, OutputStream]:
        """Parse a chat body (``data``: its JSON) and hand the chat to the engine (``size``:
        the body's bytes); every error raises here, before any response starts."""
        parsed = parse_chat(data, self.limits)
        await ready(self.engine)
        messages, tools = self.tools.inputs(parsed)
        stream = await self._start_chat(parsed, messages, tools, rid, arrival, size)
        return parsed, stream

    def chat_format(self, parsed: ChatRequest) -> ChoiceFormat:
        """How a chat's choices are written: read for tool calls when it offers tools, with
        the reasoning apart when the model reasons."""
        fmt = self.tools.format(parsed, self.texts())
        if self.reasoning() is not None:
            fmt = ReasoningChatFormat(fmt, parsed.include_reasoning, self.texts(), parsed.logprobs)
        return fmt

    async def completions(self, request: Request, body: JsonBody) -> Response:
        """``POST /v1/completions`` of the parsed ``body``; a list of prompts makes one
        engine request per prompt."""
        arrival = body.arrival
        try:
            parsed = parse_completion(body.data, self.limits)
            await ready(self.engine)
            rid = new_id("cmpl")
            streams = await self._start_all(parsed.prompts, parsed.params, rid, arrival, body.size)
            n = parsed.params.n
            prompt_texts = await self._prompt_texts(parsed.prompts, n) if parsed.echo else {}
        except Exception as exc:
            return error_response(exc)
        header = ResponseHeader(rid, self.model_name, include_usage=parsed.include_usage)
        fmt = CompletionFormat(
            self.texts(),
            parsed.logprobs is not None,
            parsed.echo,
            prompt_texts,
            parsed.params.prompt_logprobs is not None and parsed.show_prompt_logprobs,
        )
        if parsed.stream:
            return self._stream_response(streams, header, fmt, n, arrival)
        return await self._whole_response(request, streams, header, fmt, n, arrival)

    def texts(self) -> TokenTexts:
        """The token-text cache (made on first use: the tokenizer exists once started)."""
        if self._texts is None:
            self._texts = TokenTexts(self.engine.tokenizer)
        return self._texts

    def reasoning(self) -> ReasoningParser | None:
        """The server's reasoning parser, else the engine's (its ``reasoning_parser``
        option: by default the one the chat template's family takes)."""
        if self._reasoning_chosen:
            return self._reasoning
        return self.engine.reasoning_parser

    def chat_template(self) -> str:
        """The model's chat template source (read on first use, like :meth:`texts`)."""
        if self._chat_template is None:
            self._chat_template = chat_template_text(self.engine.tokenizer)
        return self._chat_template

    async def _start_chat(
        self,
        parsed: ChatRequest,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        rid: str,
        arrival: float,
        size: int,
    ) -> OutputStream:
        """Hand a chat to the engine; an error naming ``prompt`` or ``logprobs`` names the
        chat's field instead (``messages``, ``top_logprobs``: what the client sent).
        ``size``: the request body's bytes (a large request renders off the loop). Its
        reasoning is split off by :meth:`reasoning`'s parser."""
        try:
            stream = self.engine.chat(
                messages,
                self.tools.params(parsed),
                request_id=rid,
                arrival_time=arrival,
                tools=tools,
                input_size=size,
                chat_template_kwargs=parsed.template_kwargs,
                reasoning_parser=self.reasoning() or "none",
            )
            await stream.submit()  # NOTE: a large chat is tokenized off the loop; errors raise here
            return stream
        except RequestError as exc:
            param = CHAT_PARAMS.get(exc.param) if exc.param is not None else None
            if param is None or isinstance(exc, QueueFullError):
                raise
            raise bad_request(exc.message, param) from exc

    async def _start_all(
        self,
        prompts: Sequence[Prompt],
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
            fmt.note_prompt if isinstance(fmt, CompletionFormat) else None,
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
            return error_response(exc)
        if finals is None:
            logger.info("request %s: client disconnected, aborted", header.id)
            return Response(status_code=499)
        if isinstance(fmt, CompletionFormat):
            for i, final in enumerate(finals):
                for c in final.outputs:
                    fmt.note_prompt(i * n + c.index, final)
        choices = [
            fmt.whole(i * n + c.index, c) for i, final in enumerate(finals) for c in final.outputs
        ]
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        completion_tokens = sum(len(c.token_ids) for f in finals for c in f.outputs)
        counts = [c.reasoning_tokens for f in finals for c in f.outputs]
        reasoning_tokens = None if None in counts else sum(c or 0 for c in counts)
        log_whole(header.id, finals, arrival)
        body = header.response(
            fmt.response_object, choices, usage(prompt_tokens, completion_tokens, reasoning_tokens)
        )
        return JSONResponse(body)

    async def _prompt_texts(self, prompts: Sequence[Prompt], n: int) -> dict[int, str]:
        """Choice index → its prompt as text (for ``echo``); token-id prompts are decoded
        together, off the loop when they are many."""
        ids = [p for p in prompts if not isinstance(p, str)]
        decoded = iter(await self.engine.detokenize_all(ids) if ids else [])
        texts: dict[int, str] = {}
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else next(decoded)
            texts.update({i * n + j: text for j in range(n)})
        return texts


async def ready(engine: Engine) -> None:
    """Start ``engine`` if its owner has not (a 503 when it is closed or dead or stuck)."""
    if not engine.is_ready:
        await engine.start()
    ok, reason = health_of(engine)
    if not ok:
        raise APIError(
            503,
            f"the engine cannot serve: {reason}",
            type="server_error",
            code="engine_unhealthy",
        )


def health_of(engine: Engine) -> tuple[bool, str]:
    """``Engine.health`` with a death shown as its error's class only (``dead: RuntimeError``).

    The engine's reason quotes the error's message, which may hold internals (paths,
    device details); clients get the class, the server log has the rest.
    """
    return engine.health(detail=False)


def error_response(exc: BaseException) -> Response:
    """The OpenAI error answer for ``exc`` (a 499 with no body when the client left)."""
    if isinstance(exc, ClientDisconnect):
        # NOTE: no one reads this answer; a client that leaves mid-body is not a server error.
        logger.info("client disconnected while its request body was read")
        return Response(status_code=499)
    error = from_exception(exc)
    if error.status >= 500 and not isinstance(exc, (APIError, EngineError, RequestFailedError)):
        logger.exception("request failed", exc_info=exc)
    return error.response()
