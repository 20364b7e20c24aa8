"""Which linear layers keep int8 weights (the ``quantization`` engine option).

A GGUF file's conversion records the type each tensor was stored in
(:data:`GGUF_TYPES_FILE`, beside the float32 safetensors). With ``"auto"``, a linear layer
runs int8 when every checkpoint weight it is made of was stored quantized (``Q8_0``,
``Q4_K``, ...): the file's author chose a quantized model, and int8 reads a quarter of
float32's bytes. A float checkpoint (or a GGUF's F32/F16/BF16 tensors) stays float.
``"int8"`` quantizes every linear layer and the embedding; ``"none"`` none. The embedding
follows the rule of a linear layer (a lookup reads its int8 rows times their scales), and
the tied LM head is made of it, so it follows the embedding's type.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from inlinelm.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_TYPES_FILE = "gguf_tensor_types.json"
"""``{checkpoint tensor name: GGUF type name}`` of a converted GGUF file."""

INT8_SCALE = "_scale"
"""An int8 checkpoint tensor ``W`` (``I8``, [out, in]: what a GGUF file's int8 conversion
writes) comes with its float32 scales [out] as the tensor ``W + INT8_SCALE``: row ``i`` is
``W[i] * scale[i]``."""

GROUPED_TYPES = {"Q8_0": 32}
"""GGUF types whose blocks are int8 values with one scale each, by their block size: kept as
they are (int8 with a scale per group), where other types are quantized per row."""

FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def stored_types(folder: Path) -> dict[str, str]:
    """The GGUF type of each checkpoint tensor of ``folder`` ({} for a folder that is not a
    GGUF file's conversion)."""
    path = folder / GGUF_TYPES_FILE
    if not path.is_file():
        return {}
    try:
        types = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"unreadable tensor types ({e})", path=str(path)) from e
    if not isinstance(types, dict) or not all(isinstance(v, str) for v in types.values()):
        raise ModelLoadError("tensor types must map names to type names", path=str(path))
    return types


def scale_groups(sources: list[str], types: Mapping[str, str], in_features: int) -> int:
    """The scale groups per row of an int8 module made of ``sources``: a Q8_0 file's blocks
    (``in_features / 32``) when every source is stored so, else 1 (a scale per row)."""
    blocks = {GROUPED_TYPES.get(types.get(source, "F32")) for source in sources}
    if len(blocks) != 1 or None in blocks:
        return 1
    block = blocks.pop()
    assert block is not None
    return in_features // block if in_features % block == 0 else 1


def int8_modules(
    mode: str, linears: Iterable[str], sources: Mapping[str, list[str]], types: Mapping[str, str]
) -> list[str]:
    """The linear modules (of ``linears``) that run int8 under ``mode``: ``sources`` gives
    the checkpoint weights each module is made of, ``types`` their stored types."""
    if mode == "none":
        return []
    if mode == "int8":
        return list(linears)
    return [
        name
        for name in linears
        if sources.get(name)
        and all(types.get(source, "F32") not in FLOAT_TYPES for source in sources[name])
    ]
