"""The output constraint of a request: OpenAI's ``response_format`` and vLLM's ``guided_*``.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  or ``{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}``
  (a missing ``schema`` means any JSON object; ``strict`` is accepted, the schema is
  always enforced);
- ``guided_json`` (a schema object or its JSON text), ``guided_regex``, ``guided_choice``
  (a list of strings) and ``guided_grammar`` (Lark, or GBNF).

At most one of them per request; each mistake is a 400 naming the field, before the 200.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from inlinelm.api.errors import bad_request
from inlinelm.api.fields import Fields, check_text
from inlinelm.errors import RequestError
from inlinelm.structured.spec import StructuredOutput

CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# OpenAI's rule for response_format.json_schema.name.
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def read_constraint(fields: Fields) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field that set it; ``(None, None)`` for none."""
    readers: dict[str, Callable[[Fields], StructuredOutput | None]] = {
        "response_format": _read_response_format,
        "guided_json": _read_guided_json,
        "guided_regex": _read_guided_regex,
        "guided_choice": _read_guided_choice,
        "guided_grammar": _read_guided_grammar,
    }
    found = [(name, c) for name, read in readers.items() if (c := read(fields)) is not None]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(
            f"give at most one of {', '.join(CONSTRAINT_FIELDS)}; this request gives {names}",
            found[1][0],
        )
    return (found[0][1], found[0][0]) if found else (None, None)


def _build(make: Callable[[], StructuredOutput], name: str) -> StructuredOutput:
    """``make()``, its shape errors as 400s naming ``name``."""
    try:
        return make()
    except RequestError as exc:
        raise bad_request(f"{name}: {exc.message}", name) from None


def _read_response_format(fields: Fields) -> StructuredOutput | None:
    value = fields.read_object("response_format")
    if value is None:
        return None
    kind = value.read_str("type", None)
    if kind not in RESPONSE_FORMAT_TYPES:
        name = value.name("type")
        raise bad_request(f"{name} must be one of {', '.join(RESPONSE_FORMAT_TYPES)}", name)
    constraint = None
    if kind == "json_object":
        constraint = StructuredOutput.json_object()
    elif kind == "json_schema":
        constraint = _read_json_schema(value)
    value.refuse_rest()
    return constraint


def _read_json_schema(response_format: Fields) -> StructuredOutput:
    spec = response_format.read_object("json_schema")
    if spec is None:
        where = response_format.name("json_schema")
        raise bad_request(
            f"{where} is required when the type is json_schema",
            where,
            code="missing_required_parameter",
        )
    name = spec.read_str("name", None)
    if name is None or _SCHEMA_NAME.fullmatch(name) is None:
        raise bad_request(
            f"{spec.name('name')} must be 1 to 64 letters, digits, underscores or dashes",
            spec.name("name"),
        )
    spec.read_str("description", None)
    spec.read_bool("strict", False)
    schema = spec.raw("schema")
    spec.refuse_rest()
    if schema is None:
        return StructuredOutput.json_object()
    if not isinstance(schema, dict):
        raise spec.wrong_type("schema", "a JSON object (a JSON Schema)")
    return _build(lambda: StructuredOutput.json_schema(schema), spec.name("schema"))


def _read_guided_json(fields: Fields) -> StructuredOutput | None:
    schema: Any = fields.raw("guided_json")
    if schema is None:
        return None
    if not isinstance(schema, (dict, str)):
        raise fields.wrong_type("guided_json", "a JSON Schema: an object or its JSON text")
    return _build(lambda: StructuredOutput.json_schema(schema), "guided_json")


def _read_guided_regex(fields: Fields) -> StructuredOutput | None:
    pattern = fields.read_str("guided_regex", None)
    if pattern is None:
        return None
    return _build(lambda: StructuredOutput.regex(pattern), "guided_regex")


def _read_guided_choice(fields: Fields) -> StructuredOutput | None:
    choices = fields.raw("guided_choice")
    if choices is None:
        return None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise fields.wrong_type("guided_choice", "a list of strings")
    choices = [check_text(c, "guided_choice") for c in choices]
    return _build(lambda: StructuredOutput.choice(choices), "guided_choice")


def _read_guided_grammar(fields: Fields) -> StructuredOutput | None:
    grammar = fields.read_str("guided_grammar", None)
    if grammar is None:
        return None
    return _build(lambda: StructuredOutput.grammar(grammar), "guided_grammar")
