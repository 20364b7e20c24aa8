"""What a GGUF file's header says, checked without reading a weight (and without torch).

``inlinelm serve`` calls :func:`check_gguf` before it loads anything; the conversion
(``gguf_convert``) reads the same :class:`GgufHeader` from the reader it goes on to
dequantize from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.gguf_config import config_fields
from inlinelm.gpu.loading.gguf_metadata import GgufMetadata
from inlinelm.gpu.loading.gguf_names import SUPPORTED_GGUF_ARCHS, Dims, Family, family_of

_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """A checked header: the file's family, its config.json fields, its tensors' sizes."""

    family: Family
    fields: dict[str, Any]
    dims: Dims


@functools.cache
def _plain_reader() -> Any:
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map.

    The reader slices its ``data`` once per metadata value and per string, and every slice
    of an ``np.memmap`` runs the subclass's ``__array_finalize__``: for the default model's
    49,152-token vocabulary that took ~10 s of a ~12 s header read here; over a plain view of
    the same map (still mapped, not read), ~2 s. The bytes and the reader's API are gguf's.
    """
    import gguf
    import numpy as np

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self._plain = value.view(np.ndarray)

    return PlainReader


def check_gguf(path: Path) -> str:
    """The architecture of the GGUF file at ``path``, once its header passes
    :func:`read_header`; a ``ModelLoadError`` names the file and the key at fault."""
    return read_header(open_gguf(path), path).family.arch


def open_gguf(path: Path) -> Any:
    """gguf-py's reader of ``path`` (its tensors are memory-mapped, not read), over a plain
    array view of the map (see :func:`_plain_reader`)."""
    try:
        return _plain_reader()(str(path))
    # NOTE: the boundary of a third-party parser: gguf-py reports a bad magic, a short
    # file or a broken header as whatever numpy or struct raised on the way.
    except Exception as e:
        raise ModelLoadError(f"not a readable GGUF file ({e})", path=str(path)) from e


def read_header(reader: Any, path: Path) -> GgufHeader:
    """The header of the file, once the architecture is one we convert, every key its
    config is built from is present and consistent (transformers would fill a missing one
    with its own default), and the tokenizer's keys are there."""
    import gguf

    arch = GgufMetadata(reader, path, "").string(gguf.Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}",
            path=str(path),
            field=gguf.Keys.General.ARCHITECTURE,
        )
    meta = GgufMetadata(reader, path, arch)
    family = family_of(arch, meta.count(gguf.Keys.LLM.EXPERT_COUNT, 0))
    fields = config_fields(meta, family, {t.name: t for t in reader.tensors})
    for key in _TOKENIZER_KEYS:
        if key not in reader.fields:
            raise ModelLoadError(
                f"missing {key}: the tokenizer is built from it", path=str(path), field=key
            )
    return GgufHeader(family, fields, _dims(fields))


def _dims(fields: dict[str, Any]) -> Dims:
    return Dims(
        vocab=fields["vocab_size"],
        hidden=fields["hidden_size"],
        ff=fields["intermediate_size"],
        layers=fields["num_hidden_layers"],
        heads=fields["num_attention_heads"],
        kv_heads=fields["num_key_value_heads"],
        head_dim=fields["head_dim"],
        experts=fields.get("num_local_experts", 0),
        expert_ff=fields.get("moe_intermediate_size", fields["intermediate_size"]),
    )
