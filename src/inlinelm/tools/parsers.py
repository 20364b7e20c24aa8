"""Text → tool calls, one parser per model family, chosen by name or by the chat template.

Families covered:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call, plain text allowed before the first block. NousResearch Hermes 2/3, Qwen2 and
  Qwen2.5 (their templates teach this), and SmolLM2 and every model whose template knows no
  tools (:mod:`inlinelm.tools.template` teaches this format to them).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several calls separated by ``;``), as Llama 3.1, 3.2 and 3.3's
  templates ask for JSON-based tool calling.

A parser is stateless: :meth:`ToolParser.parse` reads a whole answer, and
:meth:`ToolParser.hold_from` tells a stream where text that may become a call starts.
:mod:`inlinelm.tools.family_parsers` holds the newer families' formats and
:mod:`inlinelm.tools.registry` every parser by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from inlinelm.tools.calls import ParsedOutput, ToolCall

T = TypeVar("T")


class ToolParser(Protocol):
    """Finds the tool calls in a model's answer."""

    name: str

    def parse(self, text: str) -> ParsedOutput | None:
        """The calls ``text`` holds (and the plain text around them), or None when it holds
        none or a malformed one: then it is a plain answer."""

    def hold_from(self, text: str) -> int:
        """Where a tool call may start in ``text``, the answer streamed so far.

        Text before it can be sent as content; text from it on is held back until the
        answer ends (``len(text)`` when nothing needs holding). Once a call has started,
        the index never moves for longer text.
        """


def _arguments(call: Any, *keys: str) -> dict[str, Any] | None:
    """The arguments object of a decoded call, under the first of ``keys`` it has; a JSON
    string holding an object is accepted too (some models quote it)."""
    for key in keys:
        if key not in call:
            continue
        value = call[key]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        return value if isinstance(value, dict) else None
    return {}


def call_of(value: Any, *argument_keys: str) -> ToolCall | None:
    """A decoded ``{"name", <arguments>}`` object as a call (None when it is not one)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = _arguments(value, *argument_keys)
    return None if arguments is None else ToolCall.of(value["name"], arguments)


def outside_blocks(text: str, block: re.Pattern[str], start: int) -> str | None:
    """An answer's text around its call blocks (``block`` matches one; the first starts at
    ``start``): before the first, between them and after the last, each piece stripped,
    joined by a newline; None when there is none."""
    pieces, end = [text[:start]], start
    for match in block.finditer(text, start):
        pieces.append(text[end : match.start()])
        end = match.end()
    pieces.append(text[end:])
    return "\n".join(p.strip() for p in pieces if p.strip()) or None


def partial_suffix(text: str, marker: str) -> int:
    """Where a suffix of ``text`` that is a proper prefix of ``marker`` starts
    (``len(text)`` when none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring for the families).

    A last block the answer ended inside (no closing tag) is read too. Content is the text
    around the blocks (before the first, after the last: :func:`outside_blocks`); None
    when empty.
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(
            re.escape(self.open_tag) + r"(.*?)(?:" + re.escape(self.close_tag) + r"|\Z)", re.DOTALL
        )

    def parse(self, text: str) -> ParsedOutput | None:
        start = text.find(self.open_tag)
        if start < 0:
            return None
        calls = []
        for body in self._block.findall(text, start):
            try:
                call = call_of(json.loads(body), "arguments", "parameters")
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return ParsedOutput(outside_blocks(text, self._block, start), calls)

    def hold_from(self, text: str) -> int:
        start = text.find(self.open_tag)
        return start if start >= 0 else partial_suffix(text, self.open_tag)


class Llama3JsonParser:
    """A whole answer of JSON calls ``{"name", "parameters"}`` (see the module docstring)."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput | None:
        body = text.strip().removeprefix(self.python_tag).strip()
        if not body.startswith("{"):
            return None
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except ValueError:
                return None
            call = call_of(value, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            position = _skip_separators(body, position)
        return ParsedOutput(None, calls)

    def hold_from(self, text: str) -> int:
        start = len(text) - len(text.lstrip())
        head = text[start:]
        if not head or head.startswith("{") or head.startswith(self.python_tag[: len(head)]):
            return 0  # NOTE: a prefix of the tag compares as itself; the whole tag too
        return len(text)


def _skip_separators(body: str, position: int) -> int:
    while position < len(body) and (body[position].isspace() or body[position] == ";"):
        position += 1
    return position


def registered(registry: Mapping[str, T], name: str, what: str) -> T:
    """``registry[name]``, else a ``ValueError`` naming ``what`` and the known names."""
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"no {what} named {name!r}; known: {known}") from None
