"""Chat messages (:mod:`inlinelm.api.messages`): roles, text content and its parts, tool
turns, and the 400 naming the field of a malformed message."""

from __future__ import annotations

from typing import Any

import pytest

from inlinelm.api.protocol import parse_chat
from tests.api.helpers import LIMITS, USER, chat, refused


def test_text_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse_chat({"messages": [{"role": "user", "content": parts}]}, LIMITS)
    assert request.messages == [{"role": "user", "content": "a\nb"}]


def test_tool_turns_pass_through() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
    ]
    parsed = parse_chat(chat(messages=messages), LIMITS)
    assert parsed.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert parsed.messages[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": {}}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [*USER, {"role": "tool", "content": "12 C", "tool_call_id": "call_9"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "tool", "content": "early", "tool_call_id": "call_1"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_call_id",
        ),
    ],
)
def test_malformed_messages_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    error = refused(chat(**fields))
    assert error.param == param
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
