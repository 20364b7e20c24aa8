"""A ``POST /v1/responses`` body read as the chat it stands for.

The Responses API is stateless here (``store: false``): a body that asks to store the
response or to continue one (``previous_response_id``) is a 400 saying so. Everything else
maps onto a chat completions body, which the chat path then checks and runs:

- ``input`` (text, or items: messages, ``function_call`` and ``function_call_output``;
  earlier ``reasoning`` items are dropped, as chat templates drop old thinking) and
  ``instructions`` (a system message first) → ``messages``;
- ``tools`` (functions, flat) and ``tool_choice`` → the chat's nested ones;
- ``text.format`` (``json_schema``, ``json_object``, ``text``) → ``response_format``;
- ``reasoning.effort`` → ``reasoning_effort``; ``max_output_tokens`` → ``max_tokens``;
  ``temperature``, ``top_p``, ``parallel_tool_calls``, ``user``, ``stream`` as they are.

A field the endpoint does not implement is refused by name, as on the other endpoints. An
error the chat path raises about a chat field names the Responses field it came from
(:data:`RESPONSES_PARAMS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inlinelm.api.errors import bad_request
from inlinelm.api.fields import Fields

RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "prompt": "input",
}
"""The Responses field each chat field stands for, where their names differ."""

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields read as they are, and the neutral values of those not implemented.
_COPIED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "stream")
_NEUTRAL = {
    "truncation": ("disabled",),
    "include": ([],),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "background": (False,),
}


@dataclass(slots=True)
class ResponsesRequest:
    """A Responses body as a chat body (``chat``), with what the response echoes back."""

    chat: dict[str, Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True

    @property
    def stream(self) -> bool:
        return bool(self.chat.get("stream"))


def read_responses_request(data: Any) -> ResponsesRequest:
    """The chat a Responses body stands for (a 400 naming the field for what cannot be)."""
    fields = Fields(data)
    if fields.read_bool("store", False):
        raise bad_request(
            "store: true is not supported: inlinelm keeps no responses (send store: false)",
            "store",
        )
    if fields.read_str("previous_response_id", None) is not None:
        raise bad_request(
            "previous_response_id is not supported: inlinelm keeps no responses; send the "
            "conversation so far as input items",
            "previous_response_id",
        )
    chat: dict[str, Any] = {k: fields.raw(k) for k in _COPIED if fields.has(k)}
    instructions = fields.read_str("instructions", None)
    chat["messages"] = _messages(fields.raw("input"), instructions)
    request = ResponsesRequest(chat, instructions=instructions)
    _read_tools(fields, request)
    _read_text(fields, request)
    _read_reasoning(fields, request)
    request.max_output_tokens = fields.read_int("max_output_tokens", None)
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    request.temperature = chat.get("temperature")
    request.top_p = chat.get("top_p")
    request.parallel_tool_calls = chat.get("parallel_tool_calls", True) is not False
    for key, neutral in _NEUTRAL.items():
        value = fields.raw(key)
        if value is not None and value not in neutral:
            raise bad_request(f"{key} {value!r} is not supported", key)
    fields.refuse_rest()
    return request


def _messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """``input`` (and ``instructions``) as chat messages."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _append_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _text(item, "call_id", where),
                    "content": _output_text(item.get("output"), where),
                }
            )
        elif kind != "reasoning":
            raise bad_request(f"{where}.type {kind!r} is not supported", f"{where}.type")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise bad_request(
            f"{where}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}",
            f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise bad_request(
                    f"{where}.content[{j}] must be a text part ({', '.join(_TEXT_PARTS)})",
                    f"{where}.content[{j}]",
                )
            texts.append(_text(part, "text", f"{where}.content[{j}]"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or text parts", f"{where}.content")
    return {"role": role, "content": content}


def _append_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A ``function_call`` item as a call of the assistant turn before it (consecutive
    calls share one turn, as a model writes them)."""
    call = {
        "id": _text(item, "call_id", where),
        "type": "function",
        "function": {
            "name": _text(item, "name", where),
            "arguments": _text(item, "arguments", where),
        },
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _output_text(value: Any, where: str) -> str:
    """A ``function_call_output``'s output: text, or text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)
    raise bad_request(f"{where}.output must be a string or text parts", f"{where}.output")


def _read_tools(fields: Fields, request: ResponsesRequest) -> None:
    tools = fields.raw("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be an array", "tools")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise bad_request(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            chat_tools.append({"type": "function", "function": function})
        request.tools = tools
        request.chat["tools"] = chat_tools
    choice = fields.raw("tool_choice")
    if choice is not None:
        request.tool_choice = choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        request.chat["tool_choice"] = choice


def _read_text(fields: Fields, request: ResponsesRequest) -> None:
    text = fields.read_object("text")
    if text is None:
        return
    fmt = text.raw("format")
    text.refuse_rest()
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    request.text = {"format": fmt}
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        request.chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind == "json_object":
        request.chat["response_format"] = {"type": "json_object"}
    elif kind != "text":
        raise bad_request(f"text.format.type {kind!r} is not supported", "text.format.type")


def _read_reasoning(fields: Fields, request: ResponsesRequest) -> None:
    reasoning = fields.read_object("reasoning")
    if reasoning is None:
        return
    effort = reasoning.read_str("effort", None)
    reasoning.read_str("summary", None)
    reasoning.refuse_rest()
    request.reasoning = {"effort": effort}
    if effort is not None:
        request.chat["reasoning_effort"] = effort
