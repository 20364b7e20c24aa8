"""What a GGUF file's header says, checked without reading a tensor (and without torch).

``inlinelm serve`` calls :func:`check_gguf` before it loads anything; the conversion
(``gguf_convert``) runs the same checks on the reader it goes on to dequantize from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError

SUPPORTED_GGUF_ARCHS = {"llama": True, "qwen2": False}
"""The ``general.architecture`` values we convert, each with whether llama.cpp permuted
its Q/K rows (they are un-permuted on conversion)."""
_REQUIRED_SIZES = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
)
"""``{arch}.*`` keys the config is built from (transformers fills a missing one silently)."""
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
_INT_TYPES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")


def check_gguf(path: Path) -> str:
    """The architecture of the GGUF file at ``path``, once its header passes
    :func:`check_metadata`; a ``ModelLoadError`` names the file and the key at fault."""
    return check_metadata(open_gguf(path), path)


def open_gguf(path: Path) -> Any:
    """gguf-py's reader of ``path`` (its tensors are memory-mapped, not read)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    # NOTE: the boundary of a third-party parser: gguf-py reports a bad magic, a short
    # file or a broken header as whatever numpy or struct raised on the way.
    except Exception as e:
        raise ModelLoadError(f"not a readable GGUF file ({e})", path=str(path)) from e


def check_metadata(reader: Any, path: Path) -> str:
    """The file's architecture, once the keys its config is built from are present and
    consistent (transformers would fill a missing one with its own default), and the
    tokenizer's keys are there."""
    arch = field_str(reader, "general.architecture", path)
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}",
            path=str(path),
            field="general.architecture",
        )
    sizes = {key: field_int(reader, f"{arch}.{key}", path) for key in _REQUIRED_SIZES}
    heads, hidden = sizes["attention.head_count"], sizes["embedding_length"]
    kv_key, key_length = f"{arch}.attention.head_count_kv", f"{arch}.attention.key_length"
    kv_heads = field_int(reader, kv_key, path) if kv_key in reader.fields else heads
    if key_length not in reader.fields and hidden % heads:
        raise ModelLoadError(
            f"head_count {heads} does not divide embedding_length {hidden}",
            path=str(path),
            field=f"{arch}.attention.head_count",
        )
    if heads % kv_heads:
        raise ModelLoadError(
            f"head_count_kv {kv_heads} does not divide head_count {heads}",
            path=str(path),
            field=kv_key,
        )
    for key in _TOKENIZER_KEYS:
        if key not in reader.fields:
            raise ModelLoadError(
                f"missing {key}: the tokenizer is built from it", path=str(path), field=key
            )
    return arch


def field_str(reader: Any, key: str, path: Path) -> str:
    """A UTF-8 string metadata value."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        raise ModelLoadError(f"missing {key}", path=str(path), field=key)
    if field.types != [gguf.GGUFValueType.STRING]:
        raise ModelLoadError(f"{key} is not a string", path=str(path), field=key)
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{key} is not UTF-8 ({e})", path=str(path), field=key) from e


def field_int(reader: Any, key: str, path: Path) -> int:
    """A positive integer metadata value."""
    field = reader.fields.get(key)
    if field is None:
        raise ModelLoadError(f"missing {key}", path=str(path), field=key)
    value = field.contents() if len(field.types) == 1 else None
    if field.types[0].name not in _INT_TYPES or not isinstance(value, int) or value <= 0:
        kind = "/".join(t.name for t in field.types)
        raise ModelLoadError(
            f"{key} is not a positive integer (a {kind})", path=str(path), field=key
        )
    return value
