"""response_format and vLLM's guided_* fields → SamplingParams.structured, and their 400s.

Parsing only: whether the engine makes the output fit is tested in test_structured_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from inlinelm.api.protocol import parse_chat, parse_completion
from inlinelm.structured.spec import StructuredOutput
from tests.api.helpers import LIMITS, chat, refused

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", **fields}


def structured(body: dict[str, Any]) -> StructuredOutput | None:
    parse = parse_chat if "messages" in body else parse_completion
    return parse(body, LIMITS).params.structured


@pytest.mark.parametrize("make", [chat, completion])
def test_each_field_maps_to_its_constraint(make: Any) -> None:
    json_schema = {"name": "answer", "schema": SCHEMA, "strict": True, "description": "d"}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput.json_object()),
        (
            {"response_format": {"type": "json_schema", "json_schema": json_schema}},
            StructuredOutput.json_schema(SCHEMA),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            StructuredOutput.json_object(),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_regex": r"\d+"}, StructuredOutput.regex(r"\d+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
        ({"guided_grammar": 'start: "a"+'}, StructuredOutput.grammar('start: "a"+')),
        ({"guided_json": None, "response_format": None}, None),
    ]
    for fields, expected in cases:
        assert structured(make(**fields)) == expected, fields


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "text", "schema": {}}}, "response_format.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": []},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": 1}}},
            "response_format.json_schema.strict",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "x": 1}}},
            "response_format.json_schema.x",
        ),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["yes", ""]}, "guided_choice"),
        ({"guided_choice": ["\ud800"]}, "guided_choice"),
        ({"guided_grammar": "  "}, "guided_grammar"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)
def test_malformed_shapes_are_a_400_naming_the_field(
    make: Any, fields: dict[str, Any], param: str
) -> None:
    assert refused(make(**fields)).param == param


@pytest.mark.parametrize("make", [chat, completion])
def test_more_than_one_constraint_is_a_400(make: Any) -> None:
    error = refused(make(response_format={"type": "json_object"}, guided_regex="a"))
    assert error.param == "guided_regex" and "response_format and guided_regex" in error.message
    assert refused(make(guided_choice=["a"], guided_grammar="start: x")).param == "guided_grammar"


def test_a_constraint_with_a_forced_tool_call_is_a_400() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = chat(tools=tools, tool_choice="required", guided_regex="a")
    assert refused(body).param == "guided_regex"
    auto = parse_chat(chat(tools=tools, guided_regex="a"), LIMITS)
    assert auto.params.structured == StructuredOutput.regex("a")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            chat(
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": 1}}
            ),
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", completion(guided_json="{", max_tokens=4), "guided_json"),
        ("/v1/completions", completion(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    ],
)
def test_the_400_comes_before_anything_is_submitted(
    base_url: str, submitted: list[str], path: str, body: dict[str, Any], param: str
) -> None:
    for stream in (False, True):
        reply = httpx.post(f"{base_url}{path}", json={**body, "stream": stream})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param
    assert submitted == []


def test_a_constrained_request_is_served(base_url: str) -> None:
    """The echo engine ignores the constraint; the request goes through the whole stack."""
    body = chat(max_tokens=4, response_format={"type": "json_object"})
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    reply = httpx.post(
        f"{base_url}/v1/completions", json=completion(max_tokens=4, guided_choice=["a", "b"])
    )
    assert reply.status_code == 200, reply.text
