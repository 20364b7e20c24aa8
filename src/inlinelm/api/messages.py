"""Chat messages of a request body, read into the dicts the chat template takes.

A message is a role, text content (a string, or text parts joined by newlines), and what
its role carries: an assistant's ``tool_calls``, a tool message's ``tool_call_id``
(which must answer a call an earlier assistant message made).
"""

from __future__ import annotations

from typing import Any

from inlinelm.api.errors import bad_request
from inlinelm.api.fields import Fields, check_text
from inlinelm.api.tool_request import read_tool_calls

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def read_messages(fields: Fields) -> list[dict[str, Any]]:
    """Chat messages: role plus string content or text content parts (joined)."""
    value = fields.raw("messages")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    messages = [_read_message(Fields(m, where=f"messages[{i}]")) for i, m in enumerate(value)]
    _check_tool_results(messages)
    return messages


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message answers a call an earlier assistant message made (by its id),
    as OpenAI requires: a result for no call would show the model an answer nobody asked."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls", ()):
            if "id" in call:
                call_ids.add(call["id"])
        if message["role"] == "tool" and message["tool_call_id"] not in call_ids:
            name = f"messages[{i}].tool_call_id"
            raise bad_request(
                f"{name}: {message['tool_call_id']!r} answers no tool call of an earlier "
                "assistant message",
                name,
            )


def _read_message(fields: Fields) -> dict[str, Any]:
    role = fields.read_str("role", None)
    if role not in CHAT_ROLES:
        raise bad_request(
            f"{fields.name('role')} must be one of {', '.join(CHAT_ROLES)}", fields.name("role")
        )
    message: dict[str, Any] = {"role": role, "content": _read_content(fields)}
    name = fields.read_str("name", None)
    if name is not None:
        message["name"] = name
    if role == "assistant":
        calls = read_tool_calls(fields)
        if calls:
            message["tool_calls"] = calls
    elif role == "tool":
        call_id = fields.read_str("tool_call_id", None)
        if call_id is None:
            raise bad_request(
                f"{fields.name('tool_call_id')} is required in a tool message",
                fields.name("tool_call_id"),
                code="missing_required_parameter",
            )
        message["tool_call_id"] = call_id
    fields.refuse_rest()
    return message


def _read_content(fields: Fields) -> str:
    """String content, or a list of ``{"type": "text", "text": ...}`` parts joined by newlines."""
    value = fields.raw("content")
    if value is None or isinstance(value, str):
        return check_text(value or "", fields.name("content"))
    if not isinstance(value, list):
        raise fields.wrong_type("content", "a string or a list of text parts")
    texts = []
    for i, part in enumerate(value):
        part_fields = Fields(part, where=f"{fields.name('content')}[{i}]")
        if part_fields.read_str("type", None) != "text":
            name = part_fields.name("type")
            raise bad_request(
                f"{name}: only text content parts are supported", name, code="unsupported_parameter"
            )
        text = part_fields.read_str("text", None)
        if text is None:
            raise part_fields.wrong_type("text", "a string")
        part_fields.refuse_rest()
        texts.append(text)
    return "\n".join(texts)
