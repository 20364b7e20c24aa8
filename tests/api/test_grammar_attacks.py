"""Hostile constraints over HTTP: a grammar that would crash the compiler, one whose masks
are too slow, one that fails mid-generation, thousands of choices, too many optional
properties. Each is a 400 before the 200 (or an error frame after it, never a 500 and
never an empty "stop"), and the server goes on serving (issue 19, items 1, 3 and 8)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from inlinelm.api.body import MAX_JSON_DEPTH
from inlinelm.tools import FunctionTool, forced_structure
from tests.api.test_errors import JSON, USER, check_error
from tests.structured.conftest import make_compiler
from tests.structured.grammars import (
    FAILS_LATER,
    gbnf_chain,
    lark_chain,
    optional_object,
    ref_chain_defs,
)


def ref_chain_tool(n: int) -> dict[str, Any]:
    defs = ref_chain_defs(n)
    parameters = {"type": "object", "properties": {"v": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    return {"type": "function", "function": {"name": "deep", "parameters": parameters}}


def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, headers=JSON, timeout=120)


def still_serves(base_url: str) -> None:
    reply = post(base_url, "/v1/completions", {"prompt": "ok", "max_tokens": 3})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    "body",
    [
        {"guided_grammar": lark_chain(3000).text},
        {"guided_grammar": gbnf_chain(5000).text},
        {"tools": [ref_chain_tool(1000)], "tool_choice": "required"},
    ],
    ids=["lark-3000", "gbnf-5000", "tool-ref-1000"],
)
def test_a_grammar_that_would_crash_the_process_is_a_400(
    base_url: str, body: dict[str, Any]
) -> None:
    for _ in range(2):
        reply = post(base_url, "/v1/chat/completions", {"messages": USER, **body})
        error = check_error(reply, 400, param="structured")
        assert "crashed the grammar compiler" in error["message"]
    still_serves(base_url)


def test_a_grammar_with_a_slow_first_mask_is_a_400_each_time(base_url: str) -> None:
    body = {"prompt": "a", "guided_regex": "((a{100}){100}){100}", "max_tokens": 4}
    for _ in range(2):
        error = check_error(post(base_url, "/v1/completions", body), 400, param="structured")
        assert "first token mask" in error["message"]
    still_serves(base_url)


def test_a_grammar_that_fails_mid_request_is_a_400_not_a_500(base_url: str) -> None:
    body = {"prompt": "a", "guided_grammar": FAILS_LATER, "max_tokens": 8}
    for _ in range(2):
        error = check_error(post(base_url, "/v1/completions", body), 400, param="structured")
        assert "grammar failed at output token" in error["message"]
        assert "Current row has" in error["message"] and "<state>" not in error["message"]
    still_serves(base_url)


def test_a_grammar_that_fails_mid_stream_ends_with_an_error_frame(base_url: str) -> None:
    body = {"prompt": "a", "guided_grammar": FAILS_LATER, "max_tokens": 8, "stream": True}
    events = []
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "POST", f"{base_url}/v1/completions", json=body, headers=JSON) as sse,
    ):
        assert sse.response.status_code == 200
        events = [event.data for event in sse.iter_sse()]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["param"] == "structured"
    assert "grammar failed" in last["error"]["message"]
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert "stop" not in finishes


def test_thousands_of_choices_are_followed(base_url: str) -> None:
    choices = [f"option-{i}" for i in range(2500)]
    body = {"prompt": "pick", "guided_choice": choices, "max_tokens": 16}
    reply = post(base_url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] in choices


def test_too_many_optional_properties_are_a_400(base_url: str) -> None:
    schema = json.loads(optional_object(401).text)
    body = {"prompt": "x", "guided_json": schema, "max_tokens": 4}
    error = check_error(post(base_url, "/v1/completions", body), 400, param="structured")
    assert "optional properties" in error["message"]


def _items(depth: int) -> str:
    """A JSON schema nested ``depth`` objects deep (as text: no recursion here)."""
    return '{"items":' * depth + '{"type":"string"}' + "}" * depth


def test_no_nesting_depth_is_a_500(base_url: str) -> None:
    """Nesting near Python's recursion limit (965 to 970 levels) was a RecursionError (a
    500) somewhere past the JSON parser, in every constraint field; now the body's depth
    is capped at MAX_JSON_DEPTH (a 400), and below it llguidance's own limit answers."""
    chat_head = '{"messages":[{"role":"user","content":"x"}],"max_tokens":2,'
    tool = '"tools":[{"type":"function","function":{"name":"f","parameters":%s}}]'
    shapes = {
        "/v1/completions": ['{"prompt":"x","max_tokens":2,"guided_json":%s}'],
        "/v1/chat/completions": [
            chat_head
            + '"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":%s}}}',
            chat_head + '"tool_choice":"required",' + tool + "}",
            chat_head + tool + "}",
        ],
    }
    for depth in [*range(955, 986), MAX_JSON_DEPTH - 10, MAX_JSON_DEPTH + 1]:
        for path, bodies in shapes.items():
            for body in bodies:
                reply = httpx.post(
                    f"{base_url}{path}", content=body % _items(depth), headers=JSON, timeout=60
                )
                assert reply.status_code in (200, 400), (depth, body[:60], reply.text[:200])
    deep = '{"prompt":"x","max_tokens":2,"guided_json":' + _items(MAX_JSON_DEPTH) + "}"
    reply = httpx.post(f"{base_url}/v1/completions", content=deep, headers=JSON)
    assert "nested too deeply" in check_error(reply, 400, code="invalid_json")["message"]


def test_each_forced_function_follows_its_own_definitions(tokenizer: Any) -> None:
    """Two tools both define ``Item``: under tool_choice "required" the grammar lets each
    function's arguments follow its own (they were merged: one schema's Item for both)."""

    def tool(name: str, item: dict[str, Any]) -> FunctionTool:
        parameters = {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
            "additionalProperties": False,
            "$defs": {"Item": item},
        }
        return FunctionTool(name, None, parameters)

    tools = [tool("counts", {"type": "integer"}), tool("labels", {"type": "string"})]
    compiler = make_compiler(tokenizer, num_slots=1)
    try:
        compiled = compiler.compile(forced_structure(tools, None, parallel=False))
    finally:
        compiler.close()

    def accepts(text: str) -> bool:
        matcher = compiled.new_matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text))

    assert accepts('{"name": "counts", "arguments": {"item": 3}}')
    assert accepts('{"name": "labels", "arguments": {"item": "a"}}')
    assert not accepts('{"name": "counts", "arguments": {"item": "a"}}')
    assert not accepts('{"name": "labels", "arguments": {"item": 3}}')
