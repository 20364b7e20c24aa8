"""Structured output and forced tool calls end to end over HTTP, on a real (tiny, random)
model: the engine enforces the constraint (grammar compiled off the loop, token bitmask on
the engine thread).

A random model gives no meaningful answers, but under a grammar whatever it samples fits:
the schemas here are bounded (enums, small integers, fixed-length patterns) so an answer
ends well within ``max_tokens``. Every answer is checked with ``jsonschema``. Runs on a
CPU (the tiny model) in about a minute.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from inlinelm.api import create_app
from inlinelm.config import EngineConfig
from tests.api.conftest import ServerThread, openai_client, serve

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def model_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    config = EngineConfig(model=str(tiny_model_dir), runner="model", max_num_seqs=8)
    yield from serve(create_app(config, model_name="default"))


@pytest.fixture(scope="module")
def client(model_server: ServerThread) -> Iterator[openai.OpenAI]:
    """The ``openai`` client of the tiny model's server (not the echo one)."""
    with openai_client(model_server.url) as c:
        yield c


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
    }
    reply = client.chat.completions.create(
        model="default", messages=USER, response_format=response_format, max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), ANSWER_SCHEMA)
    stream = client.chat.completions.create(
        model="default",
        messages=USER,
        response_format=response_format,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


def test_response_format_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default",
        messages=USER,
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":  # an open object may run past max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        (
            {"guided_json": ANSWER_SCHEMA},
            lambda t: jsonschema.validate(json.loads(t), ANSWER_SCHEMA) is None,
        ),
        (
            {"guided_grammar": 'start: "a" ("b" | "c") "d"'},
            lambda t: t in ("abd", "acd"),
        ),
    ],
)
def test_guided_fields_on_completions(
    model_server: ServerThread, fields: dict[str, Any], check: Any
) -> None:
    body = {"prompt": "Pick one:", "max_tokens": MAX_TOKENS, **fields}
    reply = httpx.post(f"{model_server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_regex": "("},
        {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
        {"guided_grammar": "start: undefined_rule"},
    ],
)
def test_a_constraint_the_compiler_refuses_is_a_400(
    model_server: ServerThread, fields: dict[str, Any]
) -> None:
    for stream in (False, True):
        body = {"prompt": "x", "max_tokens": 4, "stream": stream, **fields}
        reply = httpx.post(f"{model_server.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 400, reply.text


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default",
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    _check_calls(calls, {"get_weather"})


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_some_function(client: openai.OpenAI, parallel: bool) -> None:
    reply = client.chat.completions.create(
        model="default",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=MAX_TOKENS,
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    _check_calls(calls, set(PARAMETERS))
    if not parallel:
        assert len(calls) == 1


def test_required_streams_calls_the_sdk_accumulates(client: openai.OpenAI) -> None:
    state = ChatCompletionStreamState(input_tools=TOOLS)
    stream = client.chat.completions.create(
        model="default",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    for chunk in stream:
        state.handle_chunk(chunk)
    (choice,) = state.get_final_completion().choices
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls or [], set(PARAMETERS))


def test_a_follow_up_turn_after_a_forced_call(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="default", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    follow_up: list[ChatCompletionMessageParam] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
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
        model="default", messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    assert reply.choices[0].message.tool_calls is None
