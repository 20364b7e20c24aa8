"""Tool calls as plain data: what a parser finds in a model's text."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """A fresh tool-call id, ``call_<24 hex digits>`` (OpenAI's ``call_…`` shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: its ``name`` and its ``arguments`` as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    @classmethod
    def of(cls, name: str, arguments: dict[str, Any]) -> ToolCall:
        """A call whose arguments object is written as compact JSON (non-ASCII kept)."""
        return cls(name, json.dumps(arguments, ensure_ascii=False))

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The ``tool_calls`` entry of a message; with ``index``, of a stream delta."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A model's text split into its plain ``content`` (None when there is none) and ``calls``."""

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A function the model may call: OpenAI's ``{"type": "function", "function": {...}}``.

    ``parameters`` is the JSON Schema of its arguments object (None: any object).
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def to_openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and Hugging Face chat templates, ``tools=``) spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters_schema
        return {"type": "function", "function": function}

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """``parameters``, or the schema of any object when the tool gave none."""
        return self.parameters if self.parameters is not None else {"type": "object"}
