"""Typed reads of a GGUF file's metadata (without torch); each error names the file and key.

Keys are gguf's own templates (``gguf.Keys.LLM.BLOCK_COUNT``, ``"{arch}.block_count"``),
formatted with the file's architecture, so no key name is typed here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError

_INT_TYPES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_FLOAT_TYPES = ("FLOAT32", "FLOAT64")


class GgufMetadata:
    """The metadata of one GGUF file under its architecture ``arch``.

    Each read takes a gguf key template and raises ``ModelLoadError`` naming the file and
    the key when the value is missing (and no default is given) or of the wrong kind.
    """

    def __init__(self, reader: Any, path: Path, arch: str) -> None:
        self.reader = reader
        self.path = path
        self.arch = arch

    def key(self, template: str) -> str:
        """The key ``template`` names in this file (``{arch}`` filled in)."""
        return template.format(arch=self.arch)

    def has(self, template: str) -> bool:
        return self.key(template) in self.reader.fields

    def error(self, template: str, message: str) -> ModelLoadError:
        return ModelLoadError(message, path=str(self.path), field=self.key(template))

    def positive_int(self, template: str, default: int | None = None) -> int:
        """A positive integer; ``default`` when absent (required when None)."""
        value = self.count(template, default)
        if value <= 0:
            raise self.error(template, f"{self.key(template)} is {value}, not a positive integer")
        return value

    def count(self, template: str, default: int | None = None) -> int:
        """A non-negative integer; ``default`` when absent (required when None)."""
        field = self._field(template, default is None)
        if field is None:
            assert default is not None
            return default
        value = field.contents() if len(field.types) == 1 else None
        if field.types[0].name not in _INT_TYPES or not isinstance(value, int) or value < 0:
            raise self.error(template, f"{self.key(template)} is not an integer (a {_kind(field)})")
        return value

    def positive_float(self, template: str, default: float | None = None) -> float:
        """A positive finite number; ``default`` when absent (required when None).

        GGUF stores float32: the value comes back as the shortest decimal that rounds to
        the stored number (``1e-05``, not ``9.999999747378752e-06``), the number its writer
        meant and the one a config.json holds (float32 compute rounds either alike).
        """
        field = self._field(template, default is None)
        if field is None:
            assert default is not None
            return default
        value = field.contents() if len(field.types) == 1 else None
        kinds = (*_FLOAT_TYPES, *_INT_TYPES)
        if field.types[0].name not in kinds or not isinstance(value, int | float):
            raise self.error(template, f"{self.key(template)} is not a number (a {_kind(field)})")
        if not math.isfinite(value) or value <= 0:
            raise self.error(template, f"{self.key(template)} is {value}, not a positive number")
        if field.types[0].name == "FLOAT32":
            import numpy as np

            return float(str(np.float32(value)))
        return float(value)

    def boolean(self, template: str, default: bool) -> bool:
        field = self._field(template, False)
        if field is None:
            return default
        if field.types != [_value_type("BOOL")]:
            raise self.error(template, f"{self.key(template)} is not a boolean (a {_kind(field)})")
        return bool(field.contents())

    def string(self, template: str, default: str | None = None) -> str:
        """A UTF-8 string; ``default`` when absent (required when None)."""
        field = self._field(template, default is None)
        if field is None:
            assert default is not None
            return default
        if field.types != [_value_type("STRING")]:
            raise self.error(template, f"{self.key(template)} is not a string")
        try:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(template, f"{self.key(template)} is not UTF-8 ({e})") from e

    def length(self, template: str) -> int:
        """The number of entries of a required array."""
        field = self._field(template, True)
        assert field is not None
        if field.types[0] != _value_type("ARRAY"):
            raise self.error(template, f"{self.key(template)} is not an array")
        return len(field.data)

    def _field(self, template: str, required: bool) -> Any:
        field = self.reader.fields.get(self.key(template))
        if field is None and required:
            raise self.error(template, f"missing {self.key(template)}")
        return field


def _value_type(name: str) -> Any:
    import gguf

    return gguf.GGUFValueType[name]


def _kind(field: Any) -> str:
    return "/".join(t.name for t in field.types)
