"""Typed reads of a JSON request object; every mistake is a 400 naming the field.

OpenAI clients send ``null`` for "not set", so a ``null`` value always reads as the
default. Each read marks its field as known; :meth:`Fields.refuse_rest` then refuses
whatever the endpoint does not implement, so no field is ever silently ignored.
"""

from __future__ import annotations

import math
from typing import Any

from inlinelm.api.errors import APIError, bad_request

# Fields of OpenAI's API (and of vLLM's extensions) that inlinelm does not implement yet.
# Their neutral values (the ones that change nothing) are accepted; anything else is a 400.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "audio": (),
    "best_of": (1,),
    "function_call": ("none",),
    "functions": ([],),
    "metadata": ({},),
    "modalities": (["text"],),
    "parallel_tool_calls": (),
    "prediction": (),
    "reasoning_effort": (),
    "response_format": ({"type": "text"},),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "suffix": ("",),
    "tool_choice": ("none",),
    "tools": ([],),
    "web_search_options": (),
}


class Fields:
    """A JSON object being read field by field.

    Every ``read_*`` returns the default when the field is absent or ``null`` and raises an
    :class:`APIError` (400) naming the field when its type or value is wrong.
    """

    def __init__(self, data: Any, *, where: str = "") -> None:
        if not isinstance(data, dict):
            raise bad_request(f"{where or 'request body'} must be a JSON object", where or None)
        self.data: dict[str, Any] = data
        self.where = where
        self._read: set[str] = set()

    def name(self, key: str) -> str:
        """The field's full name for error messages (``messages[0].content``)."""
        return f"{self.where}.{key}" if self.where else key

    def raw(self, key: str) -> Any:
        """The field's value (``None`` when absent); marks it as read."""
        self._read.add(key)
        return self.data.get(key)

    def has(self, key: str) -> bool:
        """True when the field is present and not ``null``."""
        return self.data.get(key) is not None

    def read_bool(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.wrong_type(key, "a boolean")
        return value

    def read_int(self, key: str, default: int | None) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if not _is_int(value):
            raise self.wrong_type(key, "an integer")
        return int(value)

    def read_float(self, key: str, default: float) -> float:
        value = self.raw(key)
        if value is None:
            return default
        if not _is_number(value) or not math.isfinite(value):
            raise self.wrong_type(key, "a finite number")
        return float(value)

    def read_str(self, key: str, default: str | None) -> str | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.wrong_type(key, "a string")
        return value

    def read_int_list(self, key: str) -> list[int]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise self.wrong_type(key, "a list of integers")
        return [int(v) for v in value]

    def read_stop(self, key: str) -> list[str]:
        """A string or a list of strings (OpenAI's ``stop``)."""
        value = self.raw(key)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.wrong_type(key, "a string or a list of strings")
        return list(value)

    def read_logit_bias(self, key: str) -> dict[int, float]:
        """``{"token id": bias}``; JSON object keys are strings, so ids are parsed here."""
        value = self.raw(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.wrong_type(key, "an object mapping token ids to numbers")
        bias: dict[int, float] = {}
        for token, amount in value.items():
            if not str(token).isdigit() or not _is_number(amount):
                raise self.wrong_type(key, "an object mapping token ids to numbers")
            bias[int(token)] = float(amount)
        return bias

    def read_object(self, key: str) -> Fields | None:
        value = self.raw(key)
        return None if value is None else Fields(value, where=self.name(key))

    def wrong_type(self, key: str, expected: str) -> APIError:
        """The 400 for a field of the wrong type."""
        return bad_request(
            f"{self.name(key)} must be {expected}", self.name(key), code="invalid_type"
        )

    def refuse_rest(self) -> None:
        """Refuse every non-null field no ``read_*`` asked for: a 400 naming the first one.

        A field in :data:`NEUTRAL_VALUES` is accepted at its neutral value only.
        """
        for key in sorted(self.data):
            value = self.data[key]
            if key in self._read or value is None:
                continue
            if key in NEUTRAL_VALUES and value in NEUTRAL_VALUES[key]:
                continue
            name = self.name(key)
            if key in NEUTRAL_VALUES:
                raise bad_request(
                    f"{name} is not supported yet", name, code="unsupported_parameter"
                )
            raise bad_request(
                f"unrecognized request argument: {name}", name, code="unknown_parameter"
            )


def _is_int(value: object) -> bool:
    # NOTE: JSON true/false parse to bool, a subclass of int; they are not numbers here.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
