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
