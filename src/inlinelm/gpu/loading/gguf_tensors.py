"""A GGUF file's tensors: checked against its header, then dequantized to float32 and
turned back into the tensors transformers saves for the family.

What llama.cpp's converter did is undone per family (:class:`~.gguf_names.Family`): Q/K
rows un-permuted, Gemma's ``1 + w`` norms back to ``w`` (exact when ``1 + w`` is a float32
that holds ``w`` whole, else within 2^-24 of it for a norm below 1 in size: what the file
kept), each stacked expert tensor split into one tensor per expert.
"""

from __future__ import annotations

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
from inlinelm.gpu.model_memory import format_bytes, host_memory_available
from inlinelm.progress import progress_bar

logger = logging.getLogger(__name__)

_FLOAT32 = 4


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


def check_room(reader: Any, path: Path, out: Path) -> None:
    """Refuse a conversion whose float32 tensors cannot fit the memory or the cache disk:
    they are all held in memory, then written out."""
    sizes = [int(t.n_elements) * _FLOAT32 for t in reader.tensors]
    total = sum(sizes)
    # the tensors, plus one dequantized and one copied tensor on their way in
    need = total + 2 * max(sizes, default=0)
    available = host_memory_available()
    if available is not None and need > available:
        raise ModelLoadError(
            f"converting it to float32 needs {format_bytes(need)} of memory, and this machine "
            f"has {format_bytes(available)} available",
            path=str(path),
        )
    free_disk = shutil.disk_usage(out).free
    if total > free_disk:
        raise ModelLoadError(
            f"its float32 copy needs {format_bytes(total)} of disk in {out.parent}, which has "
            f"{format_bytes(free_disk)} free (INLINELM_CACHE chooses the folder)",
            path=str(path),
        )


def _can_dequantize(tensor_type: Any) -> bool:
    """Whether gguf-py has a dequantizer for ``tensor_type``: tried on one zero block."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def dequantize_all(
    reader: Any, path: Path, header: GgufHeader, names: TensorNames
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every weight of the file as the float32 tensors transformers saves, by name, and the
    GGUF type each came from (``"Q4_K"``, ``"F32"``, ...), by the same names."""
    import gguf

    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    items = [t for t in reader.tensors if t.name not in names.config]
    total = sum(int(t.n_bytes) for t in items)
    done = 0
    desc = f"converting {path.name} (once)"
    with progress_bar(total, desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for i, t in enumerate(items):
            bid, tensor = _lookup(names, t.name)
            array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            undone = dict(_undo(array, bid, tensor, header))
            tensors.update(undone)
            types.update(dict.fromkeys(undone, t.tensor_type.name))
            done += int(t.n_bytes)
            bar.update(int(t.n_bytes))
            if i % 40 == 0 or i == len(items) - 1:
                logger.info(
                    "dequantized %d/%d tensors (%.1f/%.1f MiB)",
                    i + 1,
                    len(items),
                    done / 2**20,
                    total / 2**20,
                )
    return tensors, types


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
