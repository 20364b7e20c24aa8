"""``POST /v1/responses``: OpenAI's Responses API over the chat path, stateless.

The body is read as the chat it stands for (:mod:`inlinelm.api.responses_request`) and runs
as one: the same template, tool parsers, reasoning split and constraints. Its answer comes
back as ``output`` items: a ``reasoning`` item (the thinking, as ``reasoning_text``), a
``message`` (``output_text``) and one ``function_call`` per call, with ``usage`` in the
API's names. Streamed, the API's event sequence: ``response.created``,
``response.in_progress``, then per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` and
``response.output_text.delta``, ``response.function_call_arguments.delta``) and its
``….done`` events, and ``response.completed`` with the whole response; every event has a
``sequence_number``. An error after the stream started is an ``error`` event. As on the
other endpoints, errors before the stream are 400s and a client that leaves aborts the
request and frees its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inlinelm.api.disconnect import finals_unless_disconnected
from inlinelm.api.errors import APIError, from_exception
from inlinelm.api.formats import ChoiceFormat
from inlinelm.api.responses import new_id
from inlinelm.api.responses_request import (
    RESPONSES_PARAMS,
    ResponsesRequest,
    read_responses_request,
)
from inlinelm.api.serving import OpenAIServing, error_response
from inlinelm.api.sse import EventStreamResponse, OutputStream, encode
from inlinelm.runtime.outputs import RequestOutput

if TYPE_CHECKING:
    from inlinelm.api.body import JsonBody

logger = logging.getLogger("inlinelm.api")


class ResponsesEndpoint:
    """``POST /v1/responses`` on the chat path of ``serving``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: Request, body: JsonBody) -> Response:
        """``POST /v1/responses`` of the parsed ``body`` (read and matched to this model by
        the router's dispatch)."""
        serving = self.serving
        try:
            asked = read_responses_request(body.data)
            rid = new_id("resp")
            try:
                parsed, stream = await serving.open_chat(asked.chat, rid, body.arrival, body.size)
            except APIError as exc:
                raise _renamed(exc) from None
        except Exception as exc:
            return error_response(exc)
        answer = Answer(rid, serving.model_name, asked, serving.chat_format(parsed))
        if asked.stream:
            return EventStreamResponse(
                _events(stream, answer), ping_s=serving.sse_ping_s, streams=[stream]
            )
        try:
            finals = await finals_unless_disconnected(request.receive, [stream])
        except Exception as exc:
            return error_response(exc)
        if finals is None:
            logger.info("request %s: client disconnected, aborted", rid)
            return Response(status_code=499)
        (final,) = finals
        answer.count(final)
        choice = final.outputs[0]
        message = answer.fmt.whole(0, choice)["message"]
        answer.finish_reason = choice.finish_reason
        return JSONResponse(answer.response(answer.items_of(message)))


def _renamed(exc: APIError) -> APIError:
    """A chat field's error as the Responses field it came from."""
    param = exc.param
    if param is None:
        return exc
    if param.startswith("response_format.json_schema."):
        exc.param = "text.format." + param.removeprefix("response_format.json_schema.")
        return exc
    head, dot, rest = param.partition(".")
    head, bracket, index = head.partition("[")
    renamed = RESPONSES_PARAMS.get(head)
    if renamed is None:
        return exc
    exc.param = renamed + bracket + index + dot + rest
    return exc


@dataclass(slots=True)
class Answer:
    """One response being built: its ids, what the request asked, its usage so far."""

    id: str
    model: str
    asked: ResponsesRequest
    fmt: ChoiceFormat
    created_at: int = field(default_factory=lambda: int(time.time()))
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: str | None = None

    def count(self, out: RequestOutput, *, delta: bool = False) -> None:
        """Take the usage of an engine output (``delta``: one step's, added up)."""
        self.input_tokens = len(out.prompt_token_ids)
        self.cached_tokens = out.num_cached_tokens
        for choice in out.outputs:
            tokens = len(choice.token_ids)
            self.output_tokens = self.output_tokens + tokens if delta else tokens
            if choice.reasoning_tokens is not None:
                self.reasoning_tokens = choice.reasoning_tokens

    def response(self, output: list[dict[str, Any]], status: str | None = None) -> dict[str, Any]:
        """The response object (``status`` None: completed, or incomplete when cut short)."""
        asked = self.asked
        if status is None:
            status = "incomplete" if self.finish_reason == "length" else "completed"
        done = status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": asked.instructions,
            "max_output_tokens": asked.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": asked.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": asked.reasoning,
            "store": False,
            "temperature": asked.temperature,
            "text": asked.text,
            "tool_choice": asked.tool_choice,
            "tools": asked.tools,
            "top_p": asked.top_p,
            "metadata": {},
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def items_of(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole chat message as output items: reasoning, message, function calls."""
        items = []
        if message.get("reasoning_content"):
            items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            items.append(message_item(new_id("msg"), message["content"]))
        for call in message.get("tool_calls") or []:
            items.append(function_call_item(new_id("fc"), call))
        return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item_id: str, call: dict[str, Any], status: str = "completed"
) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if status == "completed" else "",
        "status": status,
    }


@dataclass(slots=True)
class _OpenItem:
    """The output item a stream is writing: its kind, id, index and text so far."""

    kind: str
    id: str
    index: int
    text: str = ""


class EventWriter:
    """The events of one streamed response, numbered, with its output items as they
    close (see the module docstring)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None

    def event(self, kind: str, **payload: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(body) + b"\n\n"

    def start(self) -> bytes:
        response = self.answer.response([], "in_progress")
        return self.event("response.created", response=response) + self.event(
            "response.in_progress", response=response
        )

    def delta(self, delta: dict[str, Any]) -> bytes:
        """The events of one chunk's delta (reasoning, content, tool calls)."""
        data = b""
        if delta.get("reasoning_content"):
            data += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            data += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            data += self.close()
            data += self._call(call)
        return data

    def _text(self, kind: str, text: str) -> bytes:
        data = b""
        if self.open is None or self.open.kind != kind:
            data += self.close()
            data += self._add(kind)
        item = self.open
        assert item is not None
        item.text += text
        at = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            return data + self.event("response.reasoning_text.delta", **at, delta=text)
        return data + self.event("response.output_text.delta", **at, delta=text, logprobs=[])

    def _add(self, kind: str) -> bytes:
        prefix = "rs" if kind == "reasoning" else "msg"
        item = _OpenItem(kind, new_id(prefix), len(self.output))
        self.open = item
        if kind == "reasoning":
            added = reasoning_item(item.id, "", "in_progress")
            return self.event("response.output_item.added", output_index=item.index, item=added)
        added = message_item(item.id, None, "in_progress")
        return self.event(
            "response.output_item.added", output_index=item.index, item=added
        ) + self.event(
            "response.content_part.added",
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            part=output_text_part(""),
        )

    def close(self) -> bytes:
        """The events that end the item being written, if any."""
        item, self.open = self.open, None
        if item is None:
            return b""
        at = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            done = reasoning_item(item.id, item.text)
            self.output.append(done)
            return self.event("response.reasoning_text.done", **at, text=item.text) + self.event(
                "response.output_item.done", output_index=item.index, item=done
            )
        done = message_item(item.id, item.text)
        self.output.append(done)
        return (
            self.event("response.output_text.done", **at, text=item.text, logprobs=[])
            + self.event("response.content_part.done", **at, part=output_text_part(item.text))
            + self.event("response.output_item.done", output_index=item.index, item=done)
        )

    def _call(self, call: dict[str, Any]) -> bytes:
        index = len(self.output)
        item_id = new_id("fc")
        arguments = call["function"]["arguments"]
        done = function_call_item(item_id, call)
        self.output.append(done)
        at = {"item_id": item_id, "output_index": index}
        return (
            self.event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, "in_progress"),
            )
            + self.event("response.function_call_arguments.delta", **at, delta=arguments)
            + self.event("response.function_call_arguments.done", **at, arguments=arguments)
            + self.event("response.output_item.done", output_index=index, item=done)
        )

    def finish(self) -> bytes:
        data = self.close()
        return data + self.event("response.completed", response=self.answer.response(self.output))


async def _events(stream: OutputStream, answer: Answer) -> AsyncIterator[bytes]:
    """The response's SSE events; aborts the engine request however it ends."""
    writer = EventWriter(answer)
    fmt = answer.fmt
    try:
        yield writer.start()
        try:
            async for out in stream:
                answer.count(out, delta=True)
                for choice in out.outputs:
                    reason = choice.finish_reason
                    if choice.text or choice.reasoning:
                        chunk = fmt.delta(0, choice.text, choice.logprobs, reason, choice.reasoning)
                    elif reason is not None:
                        chunk = fmt.finish(0, reason, choice.logprobs)
                    else:
                        chunk = None
                    if reason is not None:
                        answer.finish_reason = reason
                    if chunk is not None and chunk.get("delta"):
                        data = writer.delta(chunk["delta"])
                        if data:
                            yield data
            yield writer.finish()
        except Exception as exc:
            error = from_exception(exc)
            yield writer.event("error", code=error.code, message=error.message, param=error.param)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
