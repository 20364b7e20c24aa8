"""Typed reads of a JSON request object; every mistake is a 400 naming the field.

OpenAI clients send ``null`` for "not set", so a ``null`` value always reads as the
default. Each read marks its field as known; :meth:`Fields.refuse_rest` then refuses
whatever the endpoint does not implement, so no field is ever silently ignored.

Values Python can hold but nothing downstream should see are refused here too: integers
outside the signed 64-bit range, numbers too large for a float, and strings that are not
text (JSON's ``\\ud800`` escape decodes to a lone surrogate, which has no UTF-8 form).
"""

from __future__ import annotations

import math
import re
from typing import Any

from inlinelm.api.errors import APIError, bad_request

# Fields of OpenAI's API (and of vLLM's extensions) that inlinelm does not implement yet,
# or not on every endpoint (completions take no tools). Their neutral values (the ones that
# change nothing) are accepted; anything else is a 400.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "audio": (),
    "best_of": (1,),
    "function_call": ("none",),
    "functions": ([],),
    "metadata": ({},),
    "modalities": (["text"],),
    "parallel_tool_calls": (),
    "prediction": (),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "suffix": ("",),
    "tool_choice": ("none",),
    "tools": ([],),
    "web_search_options": (),
}


# Every integer field is a signed 64-bit value downstream (seeds, token ids, counts).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# A logit_bias key: ASCII digits only (``int()`` would also take "²" or "١٢"), bounded in
# length so ``int()`` never meets Python's digit limit.
_TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")


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
        if not INT_MIN <= value <= INT_MAX:
            raise _out_of_range(self.name(key))
        return int(value)

    def read_float(self, key: str, default: float) -> float:
        value = self.raw(key)
        if value is None:
            return default
        number = _as_float(value)
        if number is None:
            raise self.wrong_type(key, "a finite number")
        return number

    def read_str(self, key: str, default: str | None) -> str | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.wrong_type(key, "a string")
        return check_text(value, self.name(key))

    def read_int_list(self, key: str) -> list[int]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise self.wrong_type(key, "a list of integers")
        if not all(INT_MIN <= v <= INT_MAX for v in value):
            raise _out_of_range(self.name(key))
        return [int(v) for v in value]

    def read_stop(self, key: str) -> list[str]:
        """A string or a list of strings (OpenAI's ``stop``)."""
        value = self.raw(key)
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.wrong_type(key, "a string or a list of strings")
        return [check_text(v, self.name(key)) for v in value]

    def read_logit_bias(self, key: str) -> dict[int, float]:
        """``{"token id": bias}``; JSON object keys are strings, so ids are parsed here.

        A key is ASCII digits (a leading ``-`` parses, then fails the range check); the
        engine checks the ids against its vocabulary and the biases against their range.
        """
        value = self.raw(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.wrong_type(key, "an object mapping token ids to numbers")
        bias: dict[int, float] = {}
        for token, amount in value.items():
            number = _as_float(amount)
            if _TOKEN_KEY.fullmatch(token) is None or number is None:
                raise self.wrong_type(key, "an object mapping token ids to finite numbers")
            if int(token) < 0:
                raise bad_request(
                    f"{self.name(key)} keys must be non-negative token ids", self.name(key)
                )
            bias[int(token)] = number
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


def check_text(value: str, name: str) -> str:
    """``value``, or a 400 naming ``name`` when it holds a lone surrogate (no UTF-8 form)."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{name} is not valid text: it holds a lone UTF-16 surrogate, which has no UTF-8 form",
            name,
        ) from None
    return value


def _out_of_range(name: str) -> APIError:
    return bad_request(f"{name} must be an integer in [-2**63, 2**63 - 1]", name)


def _as_float(value: object) -> float | None:
    """A finite JSON number as a float; None for anything else (an int past a float's range too)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _is_int(value: object) -> bool:
    # NOTE: JSON true/false parse to bool, a subclass of int; they are not numbers here.
    return isinstance(value, int) and not isinstance(value, bool)
