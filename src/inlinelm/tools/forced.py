"""``tool_choice`` "required" or a named function: a JSON Schema the answer must fit, and
the answer read back as calls.

The fixed shapes the grammar enforces:

- a named function: the answer is its arguments object, validated by its ``parameters``;
- "required": ``{"name": <one of the names>, "arguments": <that function's parameters>}``
  (an ``anyOf`` with one branch per function), or, with ``parallel_tool_calls``, a
  non-empty array of such objects;
- "required" for a model whose template teaches Hermes' format: that call object inside
  ``<tool_call>`` blocks, each closed, the answer free to end after any of them (one block
  only without ``parallel_tool_calls``), in the format the model knows
  (:func:`hermes_forced_structure`); an answer cut short by ``max_tokens`` keeps the calls
  that were complete (:class:`ForcedHermesParser`).

Each function's schema sits whole under ``$defs/<name>`` of the combined schema, its local
references (``#/$defs/Item``, ``#``) rewritten to point inside it, so every function's
arguments follow its own definitions even when two functions name theirs alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from inlinelm.structured.spec import StructuredOutput
from inlinelm.tools.calls import FunctionTool, ParsedOutput, ToolCall
from inlinelm.tools.parsers import HermesParser, call_of, partial_suffix

# The JSON's look inside a block: compact, one space after "," and ":" (as json.dumps
# writes it and as the other constraints are compiled).
_JSON_LOOK = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forced_schema(
    tools: Sequence[FunctionTool], named: str | None, parallel: bool
) -> dict[str, Any]:
    """The JSON Schema of the answer: see the module docstring."""
    if named is not None:
        (tool,) = [t for t in tools if t.name == named]
        return tool.parameters_schema
    defs = {
        tool.name: nested_under(tool.parameters_schema, f"#/$defs/{tool.name}") for tool in tools
    }
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [tool.name]},
                "arguments": {"$ref": f"#/$defs/{tool.name}"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    call: dict[str, Any] = {"anyOf": branches}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1} if parallel else call
    schema["$defs"] = defs
    return schema


def nested_under(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of ``schema`` whose local references (``#``, ``#/...``) point inside
    ``pointer``, where the copy will sit in a larger document (walked without recursion).

    NOTE: each function's schema keeps its own ``$defs`` where they are, so two functions
    may both define ``Item`` and each argument still follows its own.
    """
    root: dict[str, Any] = {}
    stack: list[tuple[Any, Any]] = [(schema, root)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            if isinstance(value, (dict, list)):
                copy: Any = {} if isinstance(value, dict) else [None] * len(value)
                stack.append((value, copy))
            elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
                copy = pointer + value[1:]
            else:
                copy = value
            target[key] = copy
    return root


def forced_structure(
    tools: Sequence[FunctionTool], named: str | None, parallel: bool
) -> StructuredOutput:
    """The constraint for ``tool_choice`` "required" (``named`` None) or a named function."""
    return StructuredOutput.json_schema(forced_schema(tools, named, parallel))


class ForcedCallParser:
    """Reads an answer of the fixed shape back as calls; anything else is a plain answer
    (an answer cut short by ``max_tokens``, or an engine that did not enforce the schema).

    It holds back the whole answer while streaming: the calls go out when it is complete.
    """

    name = "forced"

    def __init__(self, tools: Sequence[FunctionTool], named: str | None) -> None:
        self.names = {tool.name for tool in tools}
        self.named = named

    def parse(self, text: str) -> ParsedOutput | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return (
                ParsedOutput(None, [ToolCall.of(self.named, value)])
                if isinstance(value, dict)
                else None
            )
        items = value if isinstance(value, list) else [value]
        calls = [self._call(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return ParsedOutput(None, [call for call in calls if call is not None])

    def hold_from(self, text: str) -> int:
        return 0

    def _call(self, item: Any) -> ToolCall | None:
        if not isinstance(item, dict) or item.get("name") not in self.names:
            return None
        arguments = item.get("arguments")
        return ToolCall.of(item["name"], arguments) if isinstance(arguments, dict) else None


def hermes_forced_structure(tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutput:
    """``tool_choice`` "required" as Hermes ``<tool_call>`` blocks (see the module
    docstring): a Lark grammar whose blocks hold the forced call's JSON Schema."""
    schema = {**forced_schema(tools, None, False), "x-guidance": _JSON_LOOK}
    repeat = "call+" if parallel else "call"
    lark = (
        f"start: {repeat}\n"
        f'call: "{HermesParser.open_tag}\\n" body "\\n{HermesParser.close_tag}" "\\n"?\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    return StructuredOutput.grammar(lark)


class ForcedHermesParser:
    """Reads the ``<tool_call>`` blocks of a forced answer as calls (to the offered
    ``tools`` only). A last block cut short by ``max_tokens`` counts when its call is
    whole (only its closing tag is missing) and is left out otherwise, so the calls that
    were complete come back."""

    name = "forced_hermes"
    _block = re.compile(
        re.escape(HermesParser.open_tag) + r"(.*?)(" + re.escape(HermesParser.close_tag) + r"|\Z)",
        re.DOTALL,
    )

    def __init__(self, tools: Sequence[FunctionTool]) -> None:
        self.names = {tool.name for tool in tools}

    def parse(self, text: str) -> ParsedOutput | None:
        calls = []
        for body, closing in self._block.findall(text):
            if not closing:
                body = body[: partial_suffix(body, HermesParser.close_tag)]
            try:
                call = call_of(json.loads(body), "arguments")
            except ValueError:
                if not closing:
                    break  # NOTE: the call itself was cut short
                return None
            if call is None or call.name not in self.names:
                return None
            calls.append(call)
        return ParsedOutput(None, calls) if calls else None

    def hold_from(self, text: str) -> int:
        return 0
