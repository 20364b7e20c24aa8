"""What a caller may ask a request's output to fit: the plain-data record that crosses
from the caller to the grammar compiler (no tensors, no compiled state)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from inlinelm.errors import RequestError

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

_PARAM = "structured"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One constraint on a request's output; build it with a classmethod.

    ``StructuredOutput.json_schema(schema)`` (a dict or its JSON text),
    ``StructuredOutput.json_object()`` (any JSON object), ``StructuredOutput.regex(pattern)``,
    ``StructuredOutput.choice(["yes", "no"])`` or ``StructuredOutput.grammar(lark_text)``.
    ``text`` is the constraint's canonical text: the compiled grammar is cached by
    ``(kind, text)``. Shape errors raise :class:`~inlinelm.errors.RequestError` here; a
    schema, regex or grammar the compiler refuses raises it when the request is submitted.
    """

    kind: StructuredKind
    text: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """Output is JSON that validates against ``schema``."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise RequestError(f"the JSON schema is not valid JSON: {e}", param=_PARAM) from e
        if not isinstance(schema, dict):
            raise RequestError("a JSON schema must be a JSON object", param=_PARAM)
        try:
            # NOTE: keys keep their order: it is the order of the output's properties.
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise RequestError(f"the JSON schema cannot be serialised: {e}", param=_PARAM) from e
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Output is any JSON object."""
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Output matches the regular expression ``pattern`` (whole output)."""
        if not isinstance(pattern, str) or not pattern:
            raise RequestError("a regex must be a non-empty string", param=_PARAM)
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        """Output is exactly one of ``choices``."""
        if (
            not isinstance(choices, (list, tuple))
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise RequestError(
                "choices must be a non-empty list of non-empty strings", param=_PARAM
            )
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """Output fits the Lark grammar ``text`` (llguidance's Lark dialect; GBNF is
        converted)."""
        if not isinstance(text, str) or not text.strip():
            raise RequestError("a grammar must be a non-empty string", param=_PARAM)
        return cls("grammar", text)

    @property
    def choices(self) -> list[str]:
        """The choices of a ``choice`` constraint."""
        assert self.kind == "choice"
        values: list[str] = json.loads(self.text)
        return values
