"""Typed reads of a model's config.json fields; each error names the file and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError


def read_config_json(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict; a ``ModelLoadError`` naming the file when it
    cannot be read or is not a JSON object."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    # NOTE: ValueError covers bad JSON, bad UTF-8 and integers past Python's digit limit.
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"cannot read config ({e})", path=str(path)) from e
    if not isinstance(raw, dict):
        raise ModelLoadError(
            f"config is a JSON {type(raw).__name__}, not an object", path=str(path)
        )
    return raw


class ConfigFields:
    """Typed reads of config.json fields; each raises ``ModelLoadError`` naming the field."""

    def __init__(self, raw: dict[str, Any], path: str) -> None:
        self.raw = raw
        self.path = path

    def error(self, name: str, message: str) -> ModelLoadError:
        return ModelLoadError(message, path=self.path, field=name)

    def positive_int(self, name: str, default: int | None = None) -> int:
        """A positive integer; ``default`` when absent or null (required when None)."""
        value = self.raw.get(name)
        if value is None and default is not None:
            return default
        # NOTE: bool is an int subclass; `true` is not a size.
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self.error(name, f"missing or invalid {name}: {show(value)} (a positive integer)")
        return value

    def positive_number(
        self, name: str, default: float, table: dict[str, Any] | None = None
    ) -> float:
        """A positive finite number from the config (or from ``table`` inside it);
        ``default`` when absent or null."""
        value = (self.raw if table is None else table).get(name)
        if value is None:
            return default
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or value <= 0
        ):
            raise self.error(name, f"invalid {name}: {show(value)} (a positive number)")
        return float(value)

    def optional_positive_number(self, name: str) -> float | None:
        """A positive finite number, or None when absent or null."""
        if self.raw.get(name) is None:
            return None
        return self.positive_number(name, 1.0)

    def non_negative_int(self, name: str, default: int) -> int:
        """An integer >= 0; ``default`` when absent or null."""
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.error(name, f"invalid {name}: {show(value)} (an integer >= 0)")
        return value

    def int_list(self, name: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
        """A list of integers >= 0; ``default`` when absent or null."""
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise self.error(name, f"invalid {name}: {show(value)} (a list of integers >= 0)")
        return tuple(value)

    def boolean(self, name: str, default: bool) -> bool:
        """True or false; ``default`` when absent or null."""
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"invalid {name}: {show(value)} (true or false)")
        return value

    def table(self, name: str) -> dict[str, Any]:
        """A nested object; empty when absent or null."""
        value = self.raw.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(name, f"invalid {name}: {show(value)} (an object)")
        return value


def show(value: object) -> str:
    """``repr(value)``, cut short: a hostile config can hold a megabyte in one field."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
