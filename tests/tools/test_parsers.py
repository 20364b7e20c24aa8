"""Tool calls read out of model text, per family, and where a stream must hold text back."""

from __future__ import annotations

import json

import pytest

from inlinelm.tools import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    get_parser,
    parser_for_template,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}


def _hermes_block(call: dict[str, object]) -> str:
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_hermes_reads_one_call_with_no_content() -> None:
    parsed = HermesParser().parse(_hermes_block(WEATHER))
    assert parsed is not None and parsed.content is None
    (call,) = parsed.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER["arguments"]
    assert call.id.startswith("call_") and len(call.id) == 29


def test_hermes_reads_several_calls_and_the_text_before_them() -> None:
    other = {"name": "get_time", "arguments": {}}
    text = "Let me check.\n" + _hermes_block(WEATHER) + "\n" + _hermes_block(other)
    parsed = HermesParser().parse(text)
    assert parsed is not None and parsed.content == "Let me check."
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert len({c.id for c in parsed.calls}) == 2


def test_hermes_reads_an_unclosed_last_block_and_quoted_or_parameters_arguments() -> None:
    parsed = HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert parsed is not None and json.loads(parsed.calls[0].arguments) == {"a": 1}
    parsed = HermesParser().parse('<tool_call>{"name": "f", "parameters": {"b": 2}}</tool_call>')
    assert parsed is not None and json.loads(parsed.calls[0].arguments) == {"b": 2}
    parsed = HermesParser().parse('<tool_call>{"name": "f"}</tool_call>')
    assert parsed is not None and parsed.calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "A plain answer.",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        _hermes_block(WEATHER) + "<tool_call></tool_call>",
    ],
)
def test_hermes_text_without_wellformed_calls_is_a_plain_answer(text: str) -> None:
    assert HermesParser().parse(text) is None


@pytest.mark.parametrize(
    ("text", "hold"),
    [
        ("Hello", 5),
        ("Hello <", 6),
        ("Hello <tool_", 6),
        ("Hello <tool_call>{", 6),
        ("Hello <b>", 9),
        ("", 0),
    ],
)
def test_hermes_holds_text_from_a_possible_tag(text: str, hold: int) -> None:
    assert HermesParser().hold_from(text) == hold


def test_llama3_reads_a_json_call_with_parameters() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    parsed = Llama3JsonParser().parse(text)
    assert parsed is not None and parsed.content is None
    assert parsed.calls[0].name == "get_weather"
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris"}


def test_llama3_reads_the_python_tag_and_several_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": ";"}}'
    parsed = Llama3JsonParser().parse(text)
    assert parsed is not None and [c.name for c in parsed.calls] == ["a", "b"]
    assert json.loads(parsed.calls[1].arguments) == {"x": ";"}


@pytest.mark.parametrize(
    "text", ["Paris is sunny.", '{"city": "Paris"}', '{"name": "a", "parameters": {}} and text']
)
def test_llama3_text_that_is_not_only_calls_is_a_plain_answer(text: str) -> None:
    assert Llama3JsonParser().parse(text) is None


@pytest.mark.parametrize(
    ("text", "hold"),
    [("", 0), ("  ", 0), ('  {"na', 0), ("<|python", 0), ("<|python_tag|>{", 0), ("Hi", 2)],
)
def test_llama3_holds_an_answer_that_starts_like_a_call(text: str, hold: int) -> None:
    assert Llama3JsonParser().hold_from(text) == hold


def test_hermes_keeps_the_text_around_its_calls_as_content() -> None:
    text = "Checking.\n" + _hermes_block(WEATHER) + "\nI asked for the weather."
    parsed = HermesParser().parse(text)
    assert parsed is not None and [c.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == "Checking.\nI asked for the weather."


def test_the_registry_and_the_choice_by_template() -> None:
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
    assert get_parser("hermes") is PARSERS["hermes"]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        get_parser("xml")
    assert parser_for_template(None).name == "hermes"
    assert parser_for_template("{{ '<tool_call>' }} {% for tool in tools %}").name == "hermes"
    llama = '{{- "<|python_tag|>" }} Respond in the format {"name": ..., "parameters": ...}'
    assert parser_for_template(llama).name == "llama3_json"
