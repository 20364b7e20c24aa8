"""Which linear layers keep block-quantized weights, and in which kind (the
``quantization`` engine option).

A GGUF file's conversion records the type each tensor was stored in
(:data:`GGUF_TYPES_FILE`, beside the weights). With ``"auto"``, a linear layer runs
quantized when every checkpoint weight it is made of was stored quantized (``Q4_1``,
``Q4_K``, ...): the file's author chose a quantized model. It keeps the blocks its
checkpoint holds (the quantized conversion keeps the file's own where the kernel computes
them, ``Q8_0``, ``Q4_0``, ``Q4_1``: :data:`KEPT_TYPES`; ``Q4_K`` as the ``Q4_1`` blocks
of its sub-blocks: :data:`CONVERTED_TYPES`; and any other type as ``Q8_0`` blocks of its
values), and quantizes float tensors to ``Q8_0``. A float checkpoint (or a GGUF's F32/F16/BF16 tensors) stays float. ``"int8"``
quantizes every linear layer and the embedding to ``Q8_0``; ``"none"`` none. The
embedding follows the rule of a linear layer (a lookup dequantizes the rows it reads), and
the tied LM head is made of it, so it follows the embedding's kind.
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

BLOCKS_METADATA = "inlinelm.blocks"
"""The safetensors metadata key of a shard holding block-quantized tensors: a JSON object
``{tensor name: block kind}``. Such a tensor ``W`` is ``U8`` [out, in / 32 * block bytes]:
its rows' GGUF blocks, as the engine computes with them."""

KEPT_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})
"""GGUF types the kernel computes as they are stored (the others become ``Q8_0``, but
:data:`CONVERTED_TYPES`)."""

CONVERTED_TYPES = {"Q4_K": "Q4_1"}
"""GGUF types whose blocks become a kept kind's without requantizing their values: a
``Q4_K`` sub-block of 32 is ``d * sc * q - dmin * m``, a ``Q4_1`` block with ``d * sc``
and ``-dmin * m`` as its float16 scale and offset (``gguf_tensors.q4_k_as_q4_1``)."""

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


def block_kind(gguf_type: str) -> str:
    """The block kind a matrix stored as ``gguf_type`` is kept in."""
    if gguf_type in KEPT_TYPES:
        return gguf_type
    return CONVERTED_TYPES.get(gguf_type, "Q8_0")


def module_kind(sources: list[str], blocks: Mapping[str, str]) -> str:
    """The block kind of a module made of ``sources``, given the kinds of the checkpoint
    tensors held as blocks (``blocks``): their one kind, else Q8_0 (a fused module of two
    kinds computes in one, and float sources are quantized to it)."""
    kinds = {blocks.get(source, "Q8_0") for source in sources}
    return kinds.pop() if len(kinds) == 1 else "Q8_0"


def quantized_modules(
    mode: str, linears: Iterable[str], sources: Mapping[str, list[str]], types: Mapping[str, str]
) -> list[str]:
    """The linear modules (of ``linears``) that run quantized under ``mode``: ``sources``
    gives the checkpoint weights each module is made of, ``types`` their stored types."""
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
