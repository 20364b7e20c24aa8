"""A GGUF file's tensors: checked against its header, then dequantized to float32 and
turned back into the tensors transformers saves for the family (kept as blocks where the
file holds them quantized and the engine computes with block-quantized weights).

What llama.cpp's converter did is undone per family (:class:`~.gguf_names.Family`): Q/K
rows un-permuted, Gemma's ``1 + w`` norms back to ``w`` (exact when ``1 + w`` is a float32
that holds ``w`` whole, else within 2^-24 of it for a norm below 1 in size: what the file
kept), each stacked expert tensor split into one tensor per expert.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.gguf_header import GgufHeader
from inlinelm.gpu.loading.gguf_names import GgufTensor, TensorNames, tensor_shape
from inlinelm.gpu.loading.quantization import BLOCKS_METADATA, FLOAT_TYPES, block_kind
from inlinelm.gpu.model.layers.blocks import BLOCK, BLOCK_BYTES, quantize_q8_0
from inlinelm.gpu.model_memory import format_bytes, host_memory_available
from inlinelm.progress import progress_bar

logger = logging.getLogger(__name__)

_FLOAT32 = 4
_BAND_FLOATS = 1 << 22  # dequantized floats at a time, turning a matrix into Q8_0 blocks


def check_tensors(reader: Any, path: Path, header: GgufHeader, names: TensorNames) -> None:
    """Every tensor one of the family's, shaped as the metadata says, of a type gguf can
    dequantize; and every tensor the model needs present."""
    dequantizable: dict[Any, bool] = {}
    for t in reader.tensors:
        if t.name not in names.config:  # config tensors are checked as config
            _check_shape(t, path, header, names)
        if not dequantizable.setdefault(t.tensor_type, _can_dequantize(t.tensor_type)):
            raise ModelLoadError(
                f"tensor type {t.tensor_type.name} has no dequantizer in gguf-py (not a weight "
                "type inlinelm can convert)",
                path=str(path),
                field=t.name,
            )
    present = {t.name for t in reader.tensors}
    missing = next((n for n in _required_tensors(header, names) if n not in present), None)
    if missing is not None:
        raise ModelLoadError("a tensor the model needs is missing", path=str(path), field=missing)


def _check_shape(t: Any, path: Path, header: GgufHeader, names: TensorNames) -> None:
    found = names.lookup(t.name)
    if found is None:
        raise ModelLoadError(
            f"unexpected GGUF tensor {t.name!r} (not one of {header.family.arch}'s)",
            path=str(path),
            field=t.name,
        )
    bid, tensor = found
    if bid is not None and bid >= header.dims.layers:
        raise ModelLoadError(
            f"a tensor of a layer past block_count {header.dims.layers}",
            path=str(path),
            field=t.name,
        )
    expected = tensor_shape(tensor, t.name.rpartition(".")[2], header.dims, header.family)
    # NOTE: GGUF lists dimensions innermost first; numpy and torch outermost first.
    shape = tuple(reversed([int(d) for d in t.shape]))
    if shape != expected:
        raise ModelLoadError(
            f"tensor shape {shape}, but the metadata makes it {expected}",
            path=str(path),
            field=t.name,
        )


def _required_tensors(header: GgufHeader, names: TensorNames) -> Iterator[str]:
    """The GGUF tensors the model cannot do without, layer by layer (lazily: a hostile
    block_count must not build a list of a billion names)."""
    import gguf

    for name, tensor in names.globals.items():
        # NOTE: an output tensor is optional: without one the embedding is tied.
        if tensor.kind != gguf.MODEL_TENSOR.OUTPUT:
            yield name
    for bid in range(header.dims.layers):
        yield from names.layer_names(bid)


def check_room(reader: Any, path: Path, out: Path, *, quantized: bool) -> None:
    """Refuse a conversion that cannot fit the memory or the cache disk: each layer's
    tensors are held in memory (float32, with one more tensor on its way in), then
    written out; on disk, every tensor in float32, or as blocks where ``quantized`` and
    the file holds it quantized (its own blocks' bytes, or Q8_0's)."""
    groups: dict[int | None, int] = {}
    total = largest = 0
    for t in reader.tensors:
        size = int(t.n_elements) * _FLOAT32
        bid = _block_of(t.name)
        groups[bid] = groups.get(bid, 0) + size
        largest = max(largest, size)
        if quantized and t.tensor_type.name not in FLOAT_TYPES and len(t.shape) == 2:
            cols, rows = int(t.shape[0]), int(t.shape[1])
            size = rows * cols // BLOCK * BLOCK_BYTES[block_kind(t.tensor_type.name)]
        total += size
    need = max(groups.values(), default=0) + 2 * largest
    available = host_memory_available()
    if available is not None and need > available:
        raise ModelLoadError(
            f"converting it needs {format_bytes(need)} of memory (a layer in float32), and "
            f"this machine has {format_bytes(available)} available",
            path=str(path),
        )
    free_disk = shutil.disk_usage(out).free
    if total > free_disk:
        raise ModelLoadError(
            f"its converted copy needs {format_bytes(total)} of disk in {out.parent}, which "
            f"has {format_bytes(free_disk)} free (INLINELM_CACHE chooses the folder)",
            path=str(path),
        )


def _block_of(name: str) -> int | None:
    """The layer a GGUF tensor belongs to (``blk.N.*``), None for the model's own."""
    head, _, rest = name.partition(".")
    number = rest.partition(".")[0]
    return int(number) if head == "blk" and number.isdigit() else None


def _can_dequantize(tensor_type: Any) -> bool:
    """Whether gguf-py has a dequantizer for ``tensor_type``: tried on one zero block."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def write_tensors(
    reader: Any, path: Path, header: GgufHeader, names: TensorNames, out: Path, *, quantized: bool
) -> tuple[dict[str, str], dict[str, str]]:
    """Write every weight of the file into ``out`` as the tensors transformers saves, one
    safetensors shard per layer (and one for the model's own tensors), so one layer is in
    memory at a time; return the GGUF type each came from (``"Q4_K"``, ``"F32"``, ...) and
    the shard each is in (the index's weight map), by the same names.

    Float32, or with ``quantized``, each matrix the file holds quantized (but a sparse
    MLP's stacked experts, which compute in float) as the GGUF blocks the engine computes
    with (:func:`_blocks`; their kinds in each shard's
    :data:`~inlinelm.gpu.loading.quantization.BLOCKS_METADATA`): a fraction of float32's
    disk and of the next start's reading, and nothing left to quantize then.
    """
    import gguf
    from safetensors.torch import save_file

    groups: dict[int | None, list[Any]] = {}
    for t in reader.tensors:
        if t.name not in names.config:
            groups.setdefault(_block_of(t.name), []).append(t)
    order = sorted(groups, key=lambda bid: -1 if bid is None else bid)
    types: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    total = sum(int(t.n_bytes) for group in groups.values() for t in group)
    desc = f"converting {path.name} (once)"
    with progress_bar(total, desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for i, bid in enumerate(order):
            tensors: dict[str, torch.Tensor] = {}
            kinds: dict[str, str] = {}
            for t in groups[bid]:
                found_bid, tensor = _lookup(names, t.name)
                # NOTE: a sparse MLP's experts compute in float (SparseMoE): kept as the
                # file's exact values, not rounded to Q8_0 and back
                kept = quantized and not tensor.stacked and len(t.shape) == 2
                if kept and t.tensor_type.name not in FLOAT_TYPES:
                    kind, blocks = _blocks(t)
                    for name, value in _undo(blocks, found_bid, tensor, header):
                        types[name] = t.tensor_type.name
                        kinds[name] = kind
                        tensors[name] = value
                else:
                    array = gguf.quants.dequantize(t.data, t.tensor_type)
                    array = np.asarray(array, dtype=np.float32)
                    for name, value in _undo(array, found_bid, tensor, header):
                        types[name] = t.tensor_type.name
                        tensors[name] = value
                bar.update(int(t.n_bytes))
            shard = f"model-{i + 1:05d}-of-{len(order):05d}.safetensors"
            metadata = {"format": "pt"}
            if kinds:
                metadata[BLOCKS_METADATA] = json.dumps(kinds, sort_keys=True)
            save_file(tensors, str(out / shard), metadata=metadata)
            weight_map.update(dict.fromkeys(tensors, shard))
            logger.info("converted %d/%d layers of %s", i + 1, len(order), path.name)
    return types, dict(sorted(weight_map.items()))


def _blocks(t: Any) -> tuple[str, np.ndarray]:
    """A quantized GGUF matrix as the blocks the engine computes with (uint8 [rows, blocks'
    bytes]) and their kind: the file's own bytes for a kind the kernel computes
    (:data:`~inlinelm.gpu.loading.quantization.KEPT_TYPES`), Q4_K's as Q4_1 blocks
    (:func:`q4_k_as_q4_1`), else Q8_0 blocks of its dequantized rows, a band of rows at a
    time: a large matrix is never whole in float32."""
    import gguf

    data = t.data.reshape(-1, t.data.shape[-1])  # one row of blocks per weight row
    kind = block_kind(t.tensor_type.name)
    if kind == t.tensor_type.name:
        return kind, data
    if t.tensor_type.name == "Q4_K":
        return kind, q4_k_as_q4_1(data)
    cols = int(t.shape[0])  # NOTE: GGUF lists the row length first
    out = np.empty((data.shape[0], cols // BLOCK * BLOCK_BYTES[kind]), dtype=np.uint8)
    band = max(1, _BAND_FLOATS // cols)
    for r0 in range(0, data.shape[0], band):
        rows = gguf.quants.dequantize(data[r0 : r0 + band], t.tensor_type)
        values = torch.from_numpy(np.asarray(rows, dtype=np.float32))
        out[r0 : r0 + band] = quantize_q8_0(values).numpy()
    return kind, out


Q4_K_BYTES = 144
"""A Q4_K super-block: float16 ``d`` and ``dmin``, 12 bytes of 6-bit scales and minima for
its 8 sub-blocks of 32, 128 bytes of 4-bit values."""


def q4_k_as_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_K blocks (uint8 [rows, n * 144]) as the Q4_1 blocks of their sub-blocks (uint8
    [rows, n * 8 * 20]): sub-block j's values are ``d * sc_j * q - dmin * m_j``, a Q4_1
    block with scale ``d * sc_j`` and offset ``-dmin * m_j`` (exact in float32, rounded to
    float16: a relative error of at most 2^-11 of the block's scale, where Q8_0 blocks of
    the values would round each weight to 8 bits), the same 4-bit values."""
    import gguf

    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, Q4_K_BYTES)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).astype(np.float16)
    offset = (-(dmin * mins.astype(np.float32))).astype(np.float16)
    # NOTE: 32 bytes a pair of sub-blocks: 2c in their low nibbles, 2c + 1 in the high
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32)
    out = np.empty((n, 8, 20), dtype=np.uint8)
    out[:, :, 0:2] = scale.view(np.uint8).reshape(n, 8, 2)
    out[:, :, 2:4] = offset.view(np.uint8).reshape(n, 8, 2)
    out[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)  # Q4_1: byte j holds q[j], q[j + 16]
    return out.reshape(rows, -1)


def _lookup(names: TensorNames, name: str) -> tuple[int | None, GgufTensor]:
    found = names.lookup(name)
    assert found is not None, "check_tensors passed the name"
    return found


def _undo(
    array: np.ndarray, bid: int | None, tensor: GgufTensor, header: GgufHeader
) -> Iterator[tuple[str, torch.Tensor]]:
    """The transformers tensors of one GGUF tensor, llama.cpp's changes undone."""
    import gguf

    family, dims = header.family, header.dims
    if family.permuted and tensor.kind == gguf.MODEL_TENSOR.ATTN_Q:
        array = _unpermute(array, dims.heads)
    elif family.permuted and tensor.kind == gguf.MODEL_TENSOR.ATTN_K:
        array = _unpermute(array, dims.kv_heads)
    if family.norm_offset and tensor.is_norm:
        # NOTE: exact in float32 for a stored 1 + w in [0.5, 2] (Sterbenz): no float64 needed.
        array = array - np.float32(family.norm_offset)
    if not tensor.stacked:
        yield tensor.hf_name.format(bid=bid), torch.from_numpy(array.copy())
        return
    for xid in range(array.shape[0]):
        yield tensor.hf_name.format(bid=bid, xid=xid), torch.from_numpy(array[xid].copy())


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in each head's Q/K rows (weight
    or bias)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
