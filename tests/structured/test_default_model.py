"""Structured output on the default model (SmolLM2-135M-Instruct), greedy: every answer
parses and validates against its schema, streamed and not. The schemas cover nested
objects, arrays, enums, numbers with bounds, required fields and
``additionalProperties: false``; strings and arrays are bounded so every answer ends well
within ``max_tokens``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from inlinelm import Engine, SamplingParams
from inlinelm.structured import StructuredOutput
from tests.runtime.helpers import assert_drained, run

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "nested object": (
        "Describe a person who lives in Paris.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "address": {
                    "type": "object",
                    "properties": {"city": NAME, "country": NAME},
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
    ),
    "array": (
        "List three fruits.",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}
            },
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    "enum": (
        "Is the sky blue on a clear day?",
        {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    ),
    "bounded numbers": (
        "Give the year the Eiffel Tower was finished and a rating from 1 to 5.",
        {
            "type": "object",
            "properties": {
                "year": {"type": "integer", "minimum": 1800, "maximum": 2000},
                "rating": {"type": "number", "minimum": 1, "maximum": 5},
            },
            "required": ["year", "rating"],
            "additionalProperties": False,
        },
    ),
    "required and optional": (
        "Name a capital city and its country.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "country": NAME,
                "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
                "coastal": {"type": "boolean"},
            },
            "required": ["city", "country", "coastal"],
            "additionalProperties": False,
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_every_answer_of_the_default_model_fits_its_schema(streamed: bool) -> None:
    async def answer(engine: Engine, question: str, schema: dict[str, Any]) -> tuple[str, str]:
        params = SamplingParams(
            temperature=0.0, max_tokens=160, structured=StructuredOutput.json_schema(schema)
        )
        stream = engine.chat([{"role": "user", "content": question}], params)
        if not streamed:
            out = await stream
            return out.text, str(out.finish_reason)
        text, reason = "", None
        async for delta in stream:
            text += delta.text
            reason = delta.finish_reason
        return text, str(reason)

    async def main() -> None:
        async with Engine(model="default") as engine:
            for name, (question, schema) in SCHEMAS.items():
                text, reason = await answer(engine, question, schema)
                assert reason == "stop", (name, reason, text)
                jsonschema.validate(json.loads(text), schema)
            await assert_drained(engine)

    run(main(), timeout=600)
