"""Tools on chat completions: the fields, tool turns, and answers formatted as tool calls.

The echo engine answers a chat with its first message (the text the template put first,
up to the first ``<|im_end|>``), so a system message holding a ``<tool_call>`` block is an
answer holding that call: the "auto" path runs end to end without any enforcement. The
tools prompt SmolLM2 is taught follows the caller's system text; ``stop=["# Tools"]`` ends
the echo before it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from inlinelm.api.protocol import parse_chat
from inlinelm.api.responses import TokenTexts
from inlinelm.api.tool_format import ToolChatFormat
from inlinelm.runtime.outputs import CompletionOutput
from inlinelm.structured.spec import StructuredOutput
from inlinelm.tools import ForcedCallParser, FunctionTool, HermesParser, forced_schema
from tests.api.helpers import LIMITS, chat, refused

USER: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ECHOED_CALL: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": CALL},
    {"role": "user", "content": "Weather in Paris?"},
]


# -- parsing -------------------------------------------------------------------------------


def test_tools_and_tool_choice_map_to_a_tool_request() -> None:
    request = parse_chat(chat(tools=TOOLS), LIMITS)
    assert request.tools is not None
    assert request.tools.tools == [
        FunctionTool("get_weather", "Weather", PARAMETERS),
        FunctionTool("get_time"),
    ]
    assert (request.tools.choice, request.tools.named, request.tools.parallel) == (
        "auto",
        None,
        True,
    )
    assert request.params.structured is None
    none = parse_chat(chat(tools=TOOLS, tool_choice="none"), LIMITS)
    assert none.tools is not None and none.tools.offered == []
    assert parse_chat(chat(tools=[], tool_choice="auto"), LIMITS).tools is None


def test_forced_choices_carry_the_call_schema() -> None:
    tools = [FunctionTool("get_weather", "Weather", PARAMETERS), FunctionTool("get_time")]
    named = parse_chat(
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        LIMITS,
    )
    assert named.tools is not None and named.tools.named == "get_weather"
    assert named.params.structured == StructuredOutput.json_schema(PARAMETERS)
    required = parse_chat(chat(tools=TOOLS, tool_choice="required"), LIMITS)
    assert required.params.structured == StructuredOutput.json_schema(
        forced_schema(tools, None, parallel=True)
    )
    single = parse_chat(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), LIMITS
    )
    assert single.params.structured == StructuredOutput.json_schema(
        forced_schema(tools, None, parallel=False)
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
            "tools[0].function.extra",
        ),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "x"}}, "tool_choice.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (  # OpenAI's arguments are an object: a named string function came back as content
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (  # a non-object $defs was a TypeError (a 500) when the schemas were combined
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"$defs": 5}}}
                ]
            },
            "tools[0].function.parameters.$defs",
        ),
    ],
)
def test_malformed_tool_fields_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    assert refused(chat(**fields)).param == param


def test_completions_take_no_tools(base_url: str) -> None:
    body = {"prompt": "x", "max_tokens": 2, "tools": TOOLS}
    reply = httpx.post(f"{base_url}/v1/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"


# -- formatting, without an engine -----------------------------------------------------------


class _NoTexts(TokenTexts):
    def __init__(self) -> None:
        super().__init__(None)


def _stream(fmt: ToolChatFormat, pieces: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    """The chunk choices ``fmt`` makes of ``pieces`` (the last one finishing)."""
    choices = [
        fmt.delta(0, p, None, reason if i == len(pieces) - 1 else None)
        for i, p in enumerate(pieces)
    ]
    return [c for c in choices if c is not None]


def test_a_streamed_call_is_held_and_sent_as_tool_calls() -> None:
    fmt = ToolChatFormat(_NoTexts(), False, HermesParser())
    pieces = [
        "Sure",
        ". <to",
        "ol_call>\n",
        '{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}',
        "\n</tool_call>",
    ]
    sent = _stream(fmt, pieces)
    assert [c["delta"].get("content") for c in sent] == ["Sure", ". ", None]
    last = sent[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_held_text_that_is_no_call_goes_out_as_content_with_the_real_reason() -> None:
    fmt = ToolChatFormat(_NoTexts(), False, HermesParser())
    sent = _stream(fmt, ["a <b>", " and <tool_call>oops"], reason="length")
    assert "".join(c["delta"].get("content", "") for c in sent) == "a <b> and <tool_call>oops"
    assert sent[-1]["finish_reason"] == "length" and "tool_calls" not in sent[-1]["delta"]
    closing = fmt.finish(1, "stop", None)
    assert closing["delta"] == {} and closing["finish_reason"] == "stop"


def test_a_forced_call_is_sent_whole_and_parallel_false_keeps_the_first() -> None:
    tools = [FunctionTool("a"), FunctionTool("b")]
    fmt = ToolChatFormat(_NoTexts(), False, ForcedCallParser(tools, None), parallel=False)
    text = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    assert fmt.delta(0, text[:10], None) is None
    assert fmt.delta(0, text[10:], None) is None
    last = fmt.finish(0, "stop", None)
    assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == ["a"]
    whole = ToolChatFormat(_NoTexts(), False, ForcedCallParser(tools, None)).whole(
        0, CompletionOutput(0, text, [], "stop")
    )
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["a", "b"]


# -- the openai SDK against the echo server --------------------------------------------------


def test_auto_answers_with_tool_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=ECHOED_CALL, tools=TOOLS, tool_choice="auto", stop=["# Tools"]
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "system"  # the echo's text before the call
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_streams_tool_calls_the_sdk_accumulates(client: openai.OpenAI) -> None:
    state = ChatCompletionStreamState(input_tools=TOOLS)
    stream = client.chat.completions.create(
        model="default",
        messages=ECHOED_CALL,
        tools=TOOLS,
        stop=["# Tools"],
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        state.handle_chunk(chunk)
    (choice,) = state.get_final_completion().choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_call_to_a_function_not_offered_is_dropped(client: openai.OpenAI) -> None:
    """The echoed answer calls ``rm_rf``, which the request does not offer: no tool call
    comes back, whole or streamed (the answer is plain content)."""
    rogue = CALL.replace("get_weather", "rm_rf")
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": rogue},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    kwargs: dict[str, Any] = {"model": "default", "messages": messages, "tools": TOOLS}
    kwargs["stop"] = ["# Tools"]
    reply = client.chat.completions.create(**kwargs)
    (choice,) = reply.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert "rm_rf" in (choice.message.content or "")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


def test_only_the_offered_calls_of_an_answer_are_kept() -> None:
    fmt = ToolChatFormat(_NoTexts(), False, HermesParser(), names=frozenset({"get_weather"}))
    text = CALL + "\n" + CALL.replace("get_weather", "rm_rf")
    whole = fmt.whole(0, CompletionOutput(0, text, [], "stop"))
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]


def test_a_plain_answer_stays_plain(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs: dict[str, Any] = {
            "model": "default",
            "messages": USER,
            "tools": TOOLS,
            "max_tokens": 12,
        }
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(**kwargs, stream=True)
                if c.choices
            )
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            assert message.tool_calls is None
            text = message.content or ""
        # The echo: SmolLM2 is taught the tools in the system message it echoes.
        assert text.startswith("system\n# Tools\n")


def test_required_without_enforcement_falls_back_to_a_plain_answer(client: openai.OpenAI) -> None:
    """The echo engine does not fit its answer to the schema: no call is made up."""
    reply = client.chat.completions.create(
        model="default", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_a_follow_up_turn_with_the_call_and_its_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="default", messages=ECHOED_CALL, tools=TOOLS, stop=["# Tools"]
    )
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    follow_up: list[ChatCompletionMessageParam] = [
        *ECHOED_CALL,
        {
            "role": "assistant",
            "content": message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 12}'},
    ]
    reply = client.chat.completions.create(
        model="default", messages=follow_up, tools=TOOLS, max_tokens=8
    )
    assert reply.choices[0].message.content
    none = client.chat.completions.create(
        model="default", messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None
