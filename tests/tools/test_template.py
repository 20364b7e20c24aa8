"""Tools and tool turns for chat templates with and without tool support."""

from __future__ import annotations

import json
from typing import Any

from inlinelm.tools import FunctionTool, HermesParser, prepare_messages, template_supports_tools
from inlinelm.tools.template import chat_template_text, tools_prompt

TOOL = FunctionTool("get_weather", "The weather", {"type": "object"})
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
]


def test_smollm2s_template_knows_no_tools(tokenizer: Any) -> None:
    assert not template_supports_tools(chat_template_text(tokenizer))
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


def test_a_template_without_tools_is_taught_the_hermes_format() -> None:
    prepared = prepare_messages(HISTORY, [TOOL], native=False)
    system, user, assistant, tool = prepared
    assert system["role"] == "system" and system["content"] == tools_prompt([TOOL])
    assert json.dumps(TOOL.to_openai()) in system["content"]
    assert user == HISTORY[0]
    assert "tool_calls" not in assistant
    parsed = HermesParser().parse(assistant["content"])
    assert parsed is not None and parsed.calls[0].name == "get_weather"
    assert json.loads(parsed.calls[0].arguments) == {"city": "Oslo"}
    assert tool == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}


def test_the_tools_prompt_follows_the_callers_system_message() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
    system, _ = prepare_messages(messages, [TOOL], native=False)
    assert system["content"].startswith("Be brief.\n\n# Tools\n")
    assert prepare_messages(messages, [], native=False) == messages


def test_a_template_with_tools_gets_argument_objects() -> None:
    prepared = prepare_messages(HISTORY, [TOOL], native=True)
    assert prepared[0] == HISTORY[0] and prepared[2] == HISTORY[2]
    assert prepared[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_smollm2_renders_a_follow_up_turn(tokenizer: Any) -> None:
    prepared = prepare_messages(HISTORY, [TOOL], native=False)
    text = tokenizer.apply_chat_template(prepared, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>" in text and "<tool_response>\n12 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
