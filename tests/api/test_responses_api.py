"""``POST /v1/responses`` through the openai SDK: text, a JSON schema, a function call and
its follow-up with ``function_call_output``, reasoning items, ``client.responses.stream``
with the API's event sequence, the 400s, and a client that leaves mid-stream.

The echo engine's template puts the last message first, so the answer is the last input
(the instructions when they come alone, or a tool's output in a follow-up).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from inlinelm import Engine
from inlinelm.api import create_app
from tests.api.conftest import ECHO, ServerThread, openai_client, serve
from tests.helpers import wait_for
from tests.runtime.helpers import is_drained

# The last message's text, then the rest as a model would see it; naming tools, so none
# is taught in the messages.
LAST_FIRST = (
    "{{ messages[-1]['content'] }}<|im_end|>\n"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{%- if tools %}{% endif %}<|im_start|>assistant\n"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _app(**options: Any) -> Any:
    return create_app(Engine(replace(ECHO, chat_template=LAST_FIRST)), **options)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    yield from serve(_app())


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai_client(server.url) as c:
        yield c


def test_a_text_response(client: openai.OpenAI) -> None:
    response = client.responses.create(model="default", input="Hello there")
    assert response.status == "completed" and response.object == "response"
    assert response.output_text == "Hello there"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.store is False


def test_instructions_and_message_items(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="default",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "ignored by the echo"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Two "},
                    {"type": "input_text", "text": "parts"},
                ],
            },
        ],
    )
    assert response.output_text == "Two parts"
    assert response.instructions == "Be brief."


def test_a_json_schema_answer_validates(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="default",
        input='{"answer": 42}',
        text={
            "format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
        },
    )
    assert json.loads(response.output_text) == {"answer": 42}
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    free = client.responses.create(
        model="default",
        input="not json at all",
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
        max_output_tokens=32,
    )
    jsonschema.validate(json.loads(free.output_text), SCHEMA)


def test_a_function_call_and_its_follow_up(client: openai.OpenAI) -> None:
    first = client.responses.create(model="default", input=CALL, tools=[TOOL])  # type: ignore[list-item]
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    follow_up = client.responses.create(
        model="default",
        tools=[TOOL],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
    )
    assert follow_up.output_text == "Sunny, 21 C"


def test_a_forced_named_function(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="default",
        input='{"city": "Oslo"}',
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_the_stream_sends_the_apis_events_and_the_sdk_assembles_them(
    client: openai.OpenAI,
) -> None:
    with client.responses.stream(model="default", input="Streamed words here") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert all(deltas) and "".join(deltas) == "Streamed words here"
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(numbers)))
    assert final.output_text == "Streamed words here" and final.status == "completed"


def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model="default", input=CALL, tools=[TOOL]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_reasoning_items_whole_and_streamed() -> None:
    thinking = "I should answer.</think>\n\nThe answer."
    for server in serve(_app(reasoning_parser="deepseek_r1")):
        with openai_client(server.url) as client:
            whole = client.responses.create(model="default", input=thinking)
            with client.responses.stream(model="default", input=thinking) as stream:
                events = list(stream)
                streamed = stream.get_final_response()
    for response in (whole, streamed):
        kinds = [item.type for item in response.output]
        assert kinds == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.type == "reasoning" and reasoning.content is not None
        assert reasoning.content[0].text == "I should answer."
        assert response.output_text == "The answer."
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens > 0
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == "I should answer."


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
            "text.format.schema",
        ),
        ({"input": "hi", "seed": 1}, "seed"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    server: ServerThread, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_client_that_leaves_mid_stream_aborts_and_frees_the_request() -> None:
    engine = Engine(replace(ECHO, chat_template=LAST_FIRST, echo_step_s=0.01))
    for server in serve(create_app(engine)):
        body = {"input": "word " * 300, "stream": True, "max_output_tokens": 2000}
        with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=30) as reply:
            for line in reply.iter_lines():
                if "response.output_text.delta" in line:
                    break
        wait_for(lambda: is_drained(engine), what="the request to be aborted and freed")


def test_a_streamed_json_schema_answer_and_a_streamed_follow_up(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    with client.responses.stream(model="default", input='{"answer": 7}', text=text) as stream:  # type: ignore[arg-type]
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    follow_up: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
    ]
    with client.responses.stream(model="default", input=follow_up, tools=[TOOL]) as stream:  # type: ignore[list-item]
        assert stream.get_final_response().output_text == "Rain"
