"""The tool fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the tool parts of messages (an assistant's ``tool_calls``, a ``tool`` turn).

``tool_choice`` is "none", "auto" (the default when tools are given), "required", or
``{"type": "function", "function": {"name": ...}}``. "required" and a named function are
enforced by a JSON Schema (:func:`inlinelm.tools.forced_structure`), so they cannot be
combined with ``response_format`` or a ``guided_*`` field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from inlinelm.api.errors import bad_request
from inlinelm.api.fields import Fields
from inlinelm.tools.calls import FunctionTool

ToolChoice = Literal["none", "auto", "required", "function"]
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools a chat offers and how the model may use them.

    ``choice`` "function" names its function in ``named``. ``parallel``: whether an answer
    may hold several calls (OpenAI's default: true).
    """

    tools: list[FunctionTool]
    choice: ToolChoice
    named: str | None
    parallel: bool

    @property
    def forced(self) -> bool:
        """Whether the answer must be a call ("required" or a named function)."""
        return self.choice in ("required", "function")

    @property
    def offered(self) -> list[FunctionTool]:
        """The tools the model is shown: none for ``tool_choice`` "none"."""
        return [] if self.choice == "none" else self.tools


def read_tools(fields: Fields) -> ToolRequest | None:
    """The tool fields of a chat body; None when it offers no tools."""
    tools = _read_tool_list(fields)
    parallel = fields.read_bool("parallel_tool_calls", True)
    choice, named = _read_tool_choice(fields, tools)
    if not tools:
        return None
    return ToolRequest(tools, choice, named, parallel)


def _read_tool_list(fields: Fields) -> list[FunctionTool]:
    value = fields.raw("tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise fields.wrong_type("tools", "a list of tools")
    tools: list[FunctionTool] = []
    for i, item in enumerate(value):
        tool = _read_tool(Fields(item, where=f"tools[{i}]"))
        if any(t.name == tool.name for t in tools):
            name = f"tools[{i}].function.name"
            raise bad_request(f"{name}: a function named {tool.name!r} is already given", name)
        tools.append(tool)
    return tools


def _read_tool(fields: Fields) -> FunctionTool:
    kind = fields.read_str("type", None)
    if kind != "function":
        raise bad_request(
            f"{fields.name('type')} must be 'function' (the only kind of tool supported)",
            fields.name("type"),
            code="unsupported_parameter" if kind is not None else "invalid_value",
        )
    function = fields.read_object("function")
    if function is None:
        raise _missing(fields.name("function"))
    name = function.read_str("name", None)
    if name is None or _FUNCTION_NAME.fullmatch(name) is None:
        raise bad_request(
            f"{function.name('name')} must be 1 to 64 letters, digits, underscores or dashes",
            function.name("name"),
        )
    description = function.read_str("description", None)
    parameters = function.raw("parameters")
    if parameters is not None:
        _check_parameters(parameters, function.name("parameters"))
    function.read_bool("strict", False)
    function.refuse_rest()
    fields.refuse_rest()
    return FunctionTool(name, description, parameters)


def _check_parameters(parameters: Any, name: str) -> None:
    """A function's ``parameters`` must be the JSON Schema of an object (OpenAI's rule: the
    arguments are an object), with its ``$defs`` (or ``definitions``) an object too."""
    if not isinstance(parameters, dict):
        raise bad_request(
            f"{name} must be a JSON object (a JSON Schema)", name, code="invalid_type"
        )
    kind = parameters.get("type", "object")
    if kind != "object":
        raise bad_request(
            f"{name} must be the schema of an object (type 'object'), got type {kind!r}", name
        )
    for key in ("$defs", "definitions"):
        if key in parameters and not isinstance(parameters[key], dict):
            raise bad_request(f"{name}.{key} must be an object of schemas", f"{name}.{key}")


def _read_tool_choice(fields: Fields, tools: list[FunctionTool]) -> tuple[ToolChoice, str | None]:
    value = fields.raw("tool_choice")
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise bad_request(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function",
                "tool_choice",
            )
        if value == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        choice: ToolChoice = value  # type: ignore[assignment]  # checked against TOOL_CHOICES
        return choice, None
    if not isinstance(value, dict):
        raise fields.wrong_type("tool_choice", "a string or a function object")
    return "function", _read_named_choice(Fields(value, where="tool_choice"), tools)


def _read_named_choice(fields: Fields, tools: list[FunctionTool]) -> str:
    if fields.read_str("type", None) != "function":
        raise bad_request(f"{fields.name('type')} must be 'function'", fields.name("type"))
    function = fields.read_object("function")
    if function is None:
        raise _missing(fields.name("function"))
    name = function.read_str("name", None)
    function.refuse_rest()
    fields.refuse_rest()
    if name is None:
        raise _missing(function.name("name"))
    if all(t.name != name for t in tools):
        raise bad_request(
            f"{function.name('name')}: no function named {name!r} is among the tools",
            function.name("name"),
        )
    return name


def read_tool_calls(fields: Fields) -> list[dict[str, Any]] | None:
    """An assistant message's ``tool_calls``: ``[{"id", "type": "function", "function":
    {"name", "arguments"}}]`` (arguments as JSON text, as OpenAI sends them)."""
    value = fields.raw("tool_calls")
    if value is None:
        return None
    if not isinstance(value, list):
        raise fields.wrong_type("tool_calls", "a list of tool calls")
    return [
        _read_tool_call(Fields(c, where=f"{fields.name('tool_calls')}[{i}]"))
        for i, c in enumerate(value)
    ]


def _read_tool_call(fields: Fields) -> dict[str, Any]:
    call_id = fields.read_str("id", None)
    if fields.read_str("type", "function") != "function":
        raise bad_request(f"{fields.name('type')} must be 'function'", fields.name("type"))
    function = fields.read_object("function")
    if function is None:
        raise _missing(fields.name("function"))
    name = function.read_str("name", None)
    arguments = function.read_str("arguments", None)
    if name is None:
        raise _missing(function.name("name"))
    if arguments is None:
        raise _missing(function.name("arguments"))
    function.refuse_rest()
    fields.refuse_rest()
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    return call


def _missing(name: str) -> Exception:
    return bad_request(f"{name} is required", name, code="missing_required_parameter")
