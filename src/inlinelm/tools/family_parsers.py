"""Tool-call formats of the newer families, beside ``hermes`` and ``llama3_json``
(:mod:`inlinelm.tools.parsers`):

- ``qwen3_coder``: Qwen3-Coder's XML, ``<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>…</function></tool_call>``; a value is text where the function's schema
  says the parameter is a string (so ``02134`` stays ``"02134"``), else read as JSON where
  it is JSON (a number, ``true``, a list, an object) and kept as text otherwise.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (Mistral's
  v3 tokenizers), or ``[TOOL_CALLS]NAME[ARGS]{…}`` per call (its v11 ones).
- ``pythonic``: a Python list of calls with literal keyword arguments,
  ``[get_weather(city="Paris", days=3)]`` (Llama 3.2 and Llama 4's templates ask for it;
  Llama 4 may wrap it in ``<|python_start|>…<|python_end|>``), read with :mod:`ast`, never
  evaluated.

Text before the first call (and, for the XML, around the blocks) is the answer's content.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from inlinelm.tools.calls import FunctionTool, ParsedOutput, ToolCall
from inlinelm.tools.parsers import call_of, outside_blocks, partial_suffix


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls (see the module docstring). A block the answer ended inside
    is read as far as it is complete."""

    name = "qwen3_coder"
    open_tag = "<tool_call>"

    def __init__(self, tools: Sequence[FunctionTool] = ()) -> None:
        # parameter name → its JSON Schema, per function offered
        self._schemas = {
            tool.name: dict(tool.parameters_schema.get("properties") or {}) for tool in tools
        }

    def with_tools(self, tools: Sequence[FunctionTool]) -> Qwen3CoderParser:
        """This parser typing each value by the offered functions' schemas."""
        return Qwen3CoderParser(tools)

    function_tag = "<function="
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput | None:
        start = self._start(text)
        if start < 0:
            return None
        blocks = self._block if text.find(self.open_tag) == start else self._function
        calls = []
        for match in blocks.finditer(text, start):
            body = match.group(0) if blocks is self._function else match.group(1)
            function = self._function.fullmatch(body.strip())
            if function is None:
                return None
            name = function.group(1).strip()
            schemas = self._schemas.get(name, {})
            arguments = {
                key.strip(): _value(value, schemas.get(key.strip()))
                for key, value in self._parameter.findall(function[2])
            }
            if not name:
                return None
            calls.append(ToolCall.of(name, arguments))
        if not calls:
            return None
        return ParsedOutput(outside_blocks(text, blocks, start), calls)

    def hold_from(self, text: str) -> int:
        start = self._start(text)
        if start >= 0:
            return start
        return min(partial_suffix(text, self.open_tag), partial_suffix(text, self.function_tag))

    def _start(self, text: str) -> int:
        """Where the first call starts: its ``<tool_call>``, or a bare ``<function=``."""
        found = [i for i in (text.find(self.open_tag), text.find(self.function_tag)) if i >= 0]
        return min(found) if found else -1


def _value(text: str, schema: Any) -> Any:
    """A parameter's value: the text where its schema says string, else JSON where it
    parses as JSON, else the text as written."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class MistralParser:
    """``[TOOL_CALLS]`` calls in either of Mistral's forms (see the module docstring)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def parse(self, text: str) -> ParsedOutput | None:
        start = text.find(self.marker)
        if start < 0:
            return None
        calls: list[ToolCall] = []
        for part in text[start:].split(self.marker)[1:]:
            found = self._calls(part.strip())
            if found is None:
                return None
            calls += found
        return ParsedOutput(text[:start].strip() or None, calls) if calls else None

    def hold_from(self, text: str) -> int:
        start = text.find(self.marker)
        return start if start >= 0 else partial_suffix(text, self.marker)

    def _calls(self, part: str) -> list[ToolCall] | None:
        if self.args_marker in part:
            name, _, arguments = part.partition(self.args_marker)
            call = call_of({"name": name.strip(), "arguments": arguments.strip()}, "arguments")
            return None if call is None else [call]
        try:
            value, _ = json.JSONDecoder().raw_decode(part)
        except ValueError:
            return None
        values = value if isinstance(value, list) else [value]
        calls = [call_of(v, "arguments", "parameters") for v in values]
        return None if None in calls or not calls else calls  # type: ignore[return-value]


class PythonicParser:
    """A Python list of calls (see the module docstring): names and literal arguments
    only; anything else (an expression, a positional argument) makes a plain answer."""

    name = "pythonic"
    start_tag = "<|python_start|>"
    end_tag = "<|python_end|>"

    def parse(self, text: str) -> ParsedOutput | None:
        body = text.strip().removeprefix(self.start_tag).removesuffix(self.end_tag).strip()
        if not body.startswith("["):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_literal_call(node) for node in tree.elts]
        return None if None in calls else ParsedOutput(None, calls)  # type: ignore[arg-type]

    def hold_from(self, text: str) -> int:
        start = len(text) - len(text.lstrip())
        head = text[start:]
        if (
            not head
            or head.startswith("[")
            or self.start_tag.startswith(head[: len(self.start_tag)])
        ):
            return 0
        return len(text)


def _literal_call(node: ast.expr) -> ToolCall | None:
    """``name(key=literal, …)`` as a call; None for anything else."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None
    try:
        return ToolCall.of(name, arguments)
    except (TypeError, ValueError):
        return None  # NOTE: a literal JSON cannot write (a set, bytes, a complex number)


def _dotted(node: ast.expr) -> str | None:
    """``f`` or ``module.f`` as a function name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
