"""The newer families' tool calls over HTTP, and the text around calls kept as content,
whole and streamed (the echo answers with the system text: see test_chat_template_api)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import openai
import pytest

from inlinelm import Engine
from inlinelm.api import create_app
from tests.api.conftest import ECHO, openai_client, serve

# The system text alone first (what the echo answers); naming tools, so none is taught.
TOOLS_TEMPLATE = (
    "{{ messages[0]['content'] }}{% if tools %}{% endif %}<|im_end|>\n<|im_start|>assistant\n"
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANSWERS = {
    "hermes": 'Let me check.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nDone.',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"
    "</function>\n</tool_call>\nDone.",
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
    "pythonic": "[f(a=1)]",
}


@pytest.fixture(scope="module", params=sorted(ANSWERS))
def family(request: pytest.FixtureRequest) -> Iterator[tuple[str, openai.OpenAI]]:
    engine = Engine(replace(ECHO, chat_template=TOOLS_TEMPLATE))
    for server in serve(create_app(engine, tool_parser=request.param)):
        with openai_client(server.url) as client:
            yield request.param, client


def _ask(client: openai.OpenAI, name: str, **options: Any) -> Any:
    messages = [{"role": "system", "content": ANSWERS[name]}, {"role": "user", "content": "?"}]
    return client.chat.completions.create(
        model="default", messages=messages, tools=[TOOL], **options
    )


def _expected_content(name: str) -> str | None:
    return {"hermes": "Let me check.\nDone.", "qwen3_coder": "Let me check.\nDone."}.get(
        name, "Let me check." if name == "mistral" else None
    )


def test_a_call_in_the_familys_format_comes_back_with_the_text_around_it(
    family: tuple[str, openai.OpenAI],
) -> None:
    name, client = family
    choice = _ask(client, name).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("f", {"a": 1})]
    assert choice.message.content == _expected_content(name)


def test_streamed_the_call_arrives_as_tool_calls_and_no_text_is_lost(
    family: tuple[str, openai.OpenAI],
) -> None:
    name, client = family
    content = ""
    calls: list[tuple[str, dict[str, Any]]] = []
    reason = None
    for chunk in _ask(client, name, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                assert call.function is not None and call.function.name is not None
                calls.append((call.function.name, json.loads(call.function.arguments or "")))
            reason = choice.finish_reason or reason
    assert reason == "tool_calls" and calls == [("f", {"a": 1})]
    expected = _expected_content(name)
    assert content.replace("\n", "") == (expected or "").replace("\n", "")


# -- tool_choice "required" in the model's own format --------------------------------------

TWO_CALLS = "\n".join(
    f'<tool_call>\n{{"name": "f", "arguments": {{"a": {i}}}}}\n</tool_call>' for i in (1, 2)
)


@pytest.fixture(scope="module")
def hermes_client() -> Iterator[openai.OpenAI]:
    engine = Engine(replace(ECHO, chat_template=TOOLS_TEMPLATE))
    for server in serve(create_app(engine)):
        with openai_client(server.url) as client:
            yield client


def _required(client: openai.OpenAI, **options: Any) -> Any:
    messages = [{"role": "system", "content": TWO_CALLS}, {"role": "user", "content": "?"}]
    return client.chat.completions.create(
        model="default", messages=messages, tools=[TOOL], tool_choice="required", **options
    ).choices[0]


def _arguments(choice: Any) -> list[dict[str, Any]]:
    return [json.loads(c.function.arguments) for c in choice.message.tool_calls or []]


def test_required_is_forced_in_tool_call_blocks_that_may_end_after_each(
    hermes_client: openai.OpenAI,
) -> None:
    """The echo writes the system text's blocks where the grammar allows them: two with
    parallel calls; without, the grammar ends the answer after the first."""
    both = _required(hermes_client)
    assert both.finish_reason == "tool_calls" and _arguments(both) == [{"a": 1}, {"a": 2}]
    one = _required(hermes_client, parallel_tool_calls=False)
    assert one.finish_reason == "tool_calls" and _arguments(one) == [{"a": 1}]


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_by_max_tokens_keeps_its_complete_calls(
    hermes_client: openai.OpenAI, stream: bool
) -> None:
    engine = Engine(replace(ECHO, chat_template=TOOLS_TEMPLATE))
    try:
        engine.start_sync()
        first = TWO_CALLS.split("\n<tool_call>")[0]
        cut = len(engine.tokenizer.encode(first + '\n<tool_call>\n{"name"'))
    finally:
        engine.close()
    if not stream:
        choice = _required(hermes_client, max_tokens=cut)
        assert choice.finish_reason == "tool_calls" and _arguments(choice) == [{"a": 1}]
        return
    messages = [{"role": "system", "content": TWO_CALLS}, {"role": "user", "content": "?"}]
    calls: list[dict[str, Any]] = []
    for chunk in hermes_client.chat.completions.create(
        model="default",
        messages=messages,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=cut,
        stream=True,
    ):
        for c in chunk.choices:
            calls += [json.loads(t.function.arguments or "") for t in c.delta.tool_calls or []]
    assert calls == [{"a": 1}]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [256, 40])
def test_the_default_model_answers_required_with_calls_that_validate(max_tokens: int) -> None:
    """As a new user would try it: three parameters, parallel calls on; a long answer ends
    on its own, one cut by max_tokens keeps the call it completed."""
    import jsonschema

    for server in serve(create_app(Engine(model="default"))):
        with openai_client(server.url) as client:
            choice = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "What is the weather in Paris for 3 days?"}],
                tools=[WEATHER],
                tool_choice="required",
                max_tokens=max_tokens,
                temperature=0.0,
            ).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_qwen3_coder_values_are_typed_by_the_offered_functions_schema() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"zip": {"type": "string"}}},
        },
    }
    system = (
        "<tool_call>\n<function=f>\n<parameter=zip>\n12345\n</parameter>\n</function>\n</tool_call>"
    )
    engine = Engine(replace(ECHO, chat_template=TOOLS_TEMPLATE))
    for server in serve(create_app(engine, tool_parser="qwen3_coder")):
        with openai_client(server.url) as client:
            choice = client.chat.completions.create(
                model="default",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "?"}],
                tools=[tool],  # type: ignore[list-item]
            ).choices[0]
    (call,) = choice.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"zip": "12345"}
