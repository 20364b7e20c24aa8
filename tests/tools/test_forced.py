"""tool_choice "required" / a named function: the schema the answer must fit, read back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inlinelm.tools import ForcedCallParser, FunctionTool, forced_schema, forced_structure

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = FunctionTool("get_weather", "The weather in a city", CITY)
TIME = FunctionTool(
    "get_time",
    None,
    {
        "type": "object",
        "properties": {"zone": {"$ref": "#/$defs/zone"}},
        "$defs": {"zone": {"enum": ["utc", "cet"]}},
    },
)
TOOLS = [WEATHER, TIME]


def test_a_named_function_is_its_parameters_schema() -> None:
    assert forced_schema(TOOLS, "get_weather", parallel=True) == CITY
    assert forced_schema([FunctionTool("f")], "f", parallel=False) == {"type": "object"}
    structure = forced_structure(TOOLS, "get_weather", parallel=True)
    assert structure.kind == "json_schema" and json.loads(structure.text) == CITY


def test_required_is_one_call_or_an_array_of_calls() -> None:
    one = forced_schema(TOOLS, None, parallel=False)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, one)
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "utc"}}, one)
    for wrong in (
        {"name": "get_weather", "arguments": {"zone": "utc"}},
        {"name": "get_time", "arguments": {"zone": "pst"}},
        {"name": "other", "arguments": {}},
        [{"name": "get_time", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, one)
    many = forced_schema(TOOLS, None, parallel=True)
    jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)
    zone = many["$defs"]["get_time"]["properties"]["zone"]
    assert zone == {"$ref": "#/$defs/get_time/$defs/zone"}
    assert TIME.parameters is not None  # the tool is untouched
    assert TIME.parameters["properties"]["zone"] == {"$ref": "#/$defs/zone"}


def item_tool(name: str, item: dict[str, object]) -> FunctionTool:
    return FunctionTool(
        name,
        None,
        {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}, "more": {"$ref": "#"}},
            "required": ["item"],
            "additionalProperties": False,
            "$defs": {"Item": item},
        },
    )


@pytest.mark.parametrize("parallel", [False, True])
def test_each_function_keeps_its_own_definitions(parallel: bool) -> None:
    """Two functions both define ``Item`` (and refer to their own root): the arguments of
    each follow its own; they were merged, and one function's Item won for both."""
    tools = [item_tool("counts", {"type": "integer"}), item_tool("labels", {"type": "string"})]
    schema = forced_schema(tools, None, parallel=parallel)

    def check(call: dict[str, object]) -> None:
        jsonschema.validate([call] if parallel else call, schema)

    check({"name": "counts", "arguments": {"item": 3, "more": {"item": 4}}})
    check({"name": "labels", "arguments": {"item": "a", "more": {"item": "b"}}})
    for wrong in (
        {"name": "counts", "arguments": {"item": "a"}},
        {"name": "labels", "arguments": {"item": 3}},
        {"name": "labels", "arguments": {"item": "a", "more": {"item": 3}}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            check(wrong)


def test_answers_of_the_fixed_shapes_read_back_as_calls() -> None:
    named = ForcedCallParser(TOOLS, "get_weather").parse('{"city": "Oslo"}')
    assert named is not None and named.content is None
    assert [(c.name, json.loads(c.arguments)) for c in named.calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    required = ForcedCallParser(TOOLS, None)
    one = required.parse('{"name": "get_time", "arguments": {"zone": "cet"}}')
    assert one is not None and [c.name for c in one.calls] == ["get_time"]
    many = required.parse(
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}]'
    )
    assert many is not None and [c.name for c in many.calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize(
    "text",
    ['{"city": "Os', "[]", '{"name": "nope", "arguments": {}}', '{"name": "get_time"}', "hello"],
)
def test_anything_else_is_a_plain_answer(text: str) -> None:
    assert ForcedCallParser(TOOLS, None).parse(text) is None
    assert ForcedCallParser(TOOLS, None).hold_from(text) == 0
    assert ForcedCallParser(TOOLS, "get_weather").parse("[1]") is None


def test_forced_hermes_blocks_read_back_keeping_only_whole_calls() -> None:
    from inlinelm.tools import ForcedHermesParser

    parser = ForcedHermesParser([FunctionTool("f"), FunctionTool("g")])
    block = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    two = block + "\n" + block.replace('"f"', '"g"')
    assert [c.name for c in parser.parse(two).calls] == ["f", "g"]  # type: ignore[union-attr]
    cut_in_call = block + '\n<tool_call>\n{"name": "g", "argu'
    assert [c.name for c in parser.parse(cut_in_call).calls] == ["f"]  # type: ignore[union-attr]
    cut_in_tag = block + '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_'
    assert [c.name for c in parser.parse(cut_in_tag).calls] == ["f", "g"]  # type: ignore[union-attr]
    assert parser.parse('<tool_call>\n{"name": "f", "argu') is None
    assert parser.parse(block.replace('"f"', '"h"')) is None
    assert parser.parse("<tool_call>\nnot json\n</tool_call>") is None


def test_forced_hermes_structure_is_a_lark_grammar_of_closed_blocks() -> None:
    from inlinelm.tools import hermes_forced_structure

    tools = [FunctionTool("f", parameters={"type": "object"})]
    parallel = hermes_forced_structure(tools, parallel=True)
    single = hermes_forced_structure(tools, parallel=False)
    assert parallel.kind == single.kind == "grammar"
    assert "start: call+" in parallel.text and "start: call\n" in single.text
    assert '"<tool_call>\\n" body "\\n</tool_call>"' in parallel.text
