"""Load safetensors weights into the model of a checkpoint's family.

A checkpoint's tensor names map to ours by Llama's rules (Q/K/V into the fused QKV
projection, gate and up into the fused gate/up one, each a row range of it), after the
family's own renames (:attr:`~inlinelm.gpu.model.models.family.Family.checkpoint_names`);
a tensor already fused in the checkpoint (Phi-3) fills the whole parameter.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.attention.metadata import AttentionBackend
from inlinelm.gpu.loading.block_weights import (
    BlockPlan,
    BlockRows,
    allocate,
    block_kinds,
    blocks_of,
    check_blocks,
    choose,
    fill,
    stored_blocks,
)
from inlinelm.gpu.loading.model_files import weight_files
from inlinelm.gpu.loading.quantization import stored_types
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.decoder_stack import DecoderStack
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.layers.linear import Linear, onednn_packing_available
from inlinelm.gpu.model.layers.moe import SparseMoE
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.registry import build_model, family_of
from inlinelm.progress import progress_bar

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors header names


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, and a row range of it for fused ones."""

    param: str
    shard: str


def load_model(
    folder: Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_positions: int,
    kernels: Kernels | None = None,
    quantization: str = "none",
) -> DecoderModel:
    """Build the model and fill every parameter from ``folder/*.safetensors``.

    ``kernels`` defaults to :class:`~inlinelm.gpu.model.kernels.TorchKernels`.
    ``quantization`` (``"auto"``, ``"int8"`` or ``"none"``; a CPU's) picks the layers that
    keep block-quantized weights (:func:`block_plan`). Those never hold their float
    weights: each checkpoint tensor is quantized as it is read (or packed as it is, when
    the folder holds its blocks already: a GGUF file's quantized conversion), so the
    weights take their quantized bytes plus one float tensor at a time.

    Raises ``ModelLoadError`` naming the file and tensor for unreadable or truncated
    files, shape mismatches, non-float tensors (both checked from the header, before the
    tensor is read) and missing tensors; nothing half-loaded is returned. Whether the model
    fits in memory is the caller's check (``model_memory``), made before this allocates.
    """
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_model(cfg, backend, 1, kernels)
    model = model.to(dtype=dtype)
    plan = block_plan(model, cfg, folder, quantization)
    allocate(model, plan, device)
    model = model.to_empty(device=device)
    model.set_max_positions(max_positions)
    params = _destinations(model)
    loaded = _load_files(folder, cfg, params)
    _check_complete(folder, cfg, params, loaded)
    if cfg.tie_word_embeddings and model.lm_head.blocks is None:
        model.lm_head.weight_t.data.copy_(model.embed_tokens.weight.data.t())
    linears = sum(isinstance(m, Linear) for m in model.modules())
    kinds = sorted(set(plan.values()))
    logger.info(
        "quantized weights (%s) in %d of %d linear layers",
        ", ".join(kinds) or "none",
        len(set(plan) - {"embed_tokens"}),
        linears,
    )
    if onednn_packing_available(device, dtype):
        _pack_for_onednn(model)
    model.use_decoder_stack(DecoderStack.of(model))
    logger.info("loaded %s weights in %.2f s", folder.name, time.perf_counter() - start)
    # NOTE: inference only: no parameter asks autograd to record (a graph capture outside
    # inference mode would otherwise trip over the in-place KV-cache writes).
    model.requires_grad_(False)
    return model.eval()


def block_plan(model: DecoderModel, cfg: ModelConfig, folder: Path, mode: str) -> BlockPlan:
    """The :data:`~.block_weights.BlockPlan` of ``model`` under ``mode`` for the checkpoint
    in ``folder`` (:func:`~.block_weights.choose`, from the GGUF types its tensors were
    stored in and the blocks it holds)."""
    if mode == "none":
        return {}
    blocks = stored_blocks(folder)
    # NOTE: a tensor held as blocks was stored quantized, whatever the types file says
    types = {**blocks, **stored_types(folder)}
    sources: dict[str, list[str]] = {}
    for name in types:
        target = _target(name, cfg)
        if target is not None and target.param.endswith(".weight"):
            sources.setdefault(target.param.removesuffix(".weight"), []).append(name)
    return choose(model, mode, sources, types, blocks)


def _pack_for_onednn(model: DecoderModel) -> None:
    """Pack every float linear layer for oneDNN; stop at the first that refuses."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.blocks is None and not module.pack_for_onednn():
            logger.warning("oneDNN packing refused at %s: plain matmuls from there on", name)
            return


def _destinations(model: DecoderModel) -> dict[str, torch.Tensor | BlockRows]:
    """Every loadable tensor under its checkpoint-style name, in the checkpoint's orientation
    (a ``Linear``'s transposed storage is exposed as a ``.weight`` view of shape [out, in],
    a quantized module's weights as :class:`BlockRows`; the experts of a sparse MLP by their
    per-expert names)."""
    views: dict[str, torch.Tensor | BlockRows] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        blocks = blocks_of(module)
        if isinstance(module, SparseMoE):
            views.update({f"{prefix}{k}": v for k, v in module.expert_weights().items()})
        elif blocks is not None:
            views[f"{prefix}weight"] = BlockRows(blocks, 0, blocks.rows)
            if isinstance(module, Linear) and module.bias is not None:
                views[f"{prefix}bias"] = module.bias.data
        elif isinstance(module, Linear):
            views[f"{prefix}weight"] = module.weight_t.data.t()
            if module.bias is not None:
                views[f"{prefix}bias"] = module.bias.data
        else:
            for pname, param in module.named_parameters(recurse=False):
                views[f"{prefix}{pname}"] = param.data
    return views


def _load_files(
    folder: Path, cfg: ModelConfig, params: dict[str, torch.Tensor | BlockRows]
) -> set[_Target]:
    from safetensors import SafetensorError

    loaded: set[_Target] = set()
    files = weight_files(folder)
    total = sum(path.stat().st_size for path in files)
    desc = f"loading {folder.name} weights"
    with progress_bar(total, desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for i, path in enumerate(files):
            try:
                num_bytes = _load_file(path, cfg, params, loaded, bar)
            # NOTE: the boundary of the file read: safetensors reports a bad header or data
            # as SafetensorError, the OS an unreadable file as OSError.
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(
                    f"unreadable or truncated safetensors file ({e})", path=str(path)
                ) from e
            bar.update(path.stat().st_size - num_bytes)  # the header and skipped tensors
            logger.info(
                "loaded weight file %d/%d: %s (%.1f MiB)",
                i + 1,
                len(files),
                path.name,
                path.stat().st_size / 2**20,
            )
    return loaded


def _load_file(
    path: Path,
    cfg: ModelConfig,
    params: dict[str, torch.Tensor | BlockRows],
    loaded: set[_Target],
    bar: Any,
) -> int:
    """Copy the tensors of one file into ``params`` (adding them to ``loaded``), advancing
    ``bar`` by each tensor's bytes; returns the bytes counted. Each tensor's dtype and
    shape are checked from the header before its data is read. A ``U8`` tensor is a
    weight's GGUF blocks, of the kind the shard's metadata names
    (:func:`~.block_weights.block_kinds`)."""
    from safetensors import safe_open

    num_bytes = 0
    with safe_open(str(path), framework="pt") as f:
        kinds = block_kinds(f.metadata(), path)
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            target = _target(name, cfg)
            if target is None:
                continue
            header = f.get_slice(name)
            dest = _destination(target, params, cfg, path, name)
            shape = tuple(header.get_shape())
            _check_header(header.get_dtype(), shape, dest, path, name, kinds.get(name))
            tensor = f.get_tensor(name)
            fill(dest, tensor, kinds.get(name) if header.get_dtype() == "U8" else None)
            loaded.add(target)
            size = tensor.numel() * tensor.element_size()
            bar.update(size)
            num_bytes += size
    return num_bytes


def _target(name: str, cfg: ModelConfig) -> _Target | None:
    """Map a Hugging Face tensor name to our parameter and shard (None: not ours to load).
    A bare decoder's names (``layers.0...``, as sentence-transformers saves an embedder
    such as Qwen3-Embedding) read as the causal LM's ``model.`` ones."""
    if not name.startswith(("model.", "lm_head.")):
        name = f"model.{name}"
    if name == "model.embed_tokens.weight":
        return _Target("embed_tokens.weight", "all")
    if name == "model.norm.weight":
        return _Target("norm.weight", "all")
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else _Target("lm_head.weight", "all")
    match = _LAYER.match(name)
    if match is None:
        return None
    prefix, rest = f"layers.{match.group(1)}.", match.group(2)
    for pattern, replacement in family_of(cfg.model_type).checkpoint_names:
        rest = re.sub(pattern, replacement, rest)
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
        "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
        "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
        "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
        "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        dest, shard = fused[module]
        return _Target(f"{prefix}{dest}.{kind}", shard)
    if "rotary_emb" in rest:
        return None
    return _Target(f"{prefix}{rest}", "all")


def _rows(target: _Target, cfg: ModelConfig) -> tuple[int, int] | None:
    q, kv, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    ranges = {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
    }
    return ranges.get(target.shard)


def _destination(
    target: _Target,
    params: dict[str, torch.Tensor | BlockRows],
    cfg: ModelConfig,
    path: Path,
    name: str,
) -> torch.Tensor | BlockRows:
    """The parameter (or the rows of a fused one) a checkpoint tensor is copied into."""
    if target.param not in params:
        raise ModelLoadError(
            "tensor does not belong to this architecture", path=str(path), field=name
        )
    dest = params[target.param]
    rows = _rows(target, cfg)
    return dest if rows is None else dest[rows[0] : rows[1]]


def _check_header(
    dtype: str,
    shape: tuple[int, ...],
    dest: torch.Tensor | BlockRows,
    path: Path,
    name: str,
    kind: str | None,
) -> None:
    """A checkpoint tensor's header entry against the parameter it fills (a ``U8`` tensor:
    blocks of its ``kind``, for a weight matrix)."""
    if dtype == "U8" and len(dest.shape) == 2:
        check_blocks(kind, shape, (dest.shape[0], dest.shape[1]), path, name)
        return
    if dtype not in _FLOAT_DTYPES:
        raise ModelLoadError(
            f"unsupported weight dtype {dtype} (supported: {', '.join(_FLOAT_DTYPES)}, and "
            "U8 for a weight matrix's GGUF blocks)",
            path=str(path),
            field=name,
        )
    if shape != tuple(dest.shape):
        raise ModelLoadError(
            f"shape mismatch: file has {shape}, model expects {tuple(dest.shape)}",
            path=str(path),
            field=name,
        )


def _check_complete(
    folder: Path,
    cfg: ModelConfig,
    params: dict[str, torch.Tensor | BlockRows],
    loaded: set[_Target],
) -> None:
    # NOTE: a fused parameter is complete from its shards or from one fused tensor.
    whole = {t.param for t in loaded if t.shard == "all"}
    expected = {
        _Target(name, shard)
        for name in params
        for shard in (("all",) if name in whole else _shards(name, cfg))
    }
    if cfg.tie_word_embeddings:
        expected.discard(_Target("lm_head.weight", "all"))
    missing = sorted(f"{t.param}[{t.shard}]" for t in expected - loaded)
    if missing:
        raise ModelLoadError(
            f"{len(missing)} weight tensors missing, first: {missing[0]}",
            path=str(folder),
            field=missing[0],
        )


def _shards(name: str, cfg: ModelConfig) -> tuple[str, ...]:
    if ".qkv_proj." in name:
        return ("q", "k", "v")
    if ".gate_up_proj." in name:
        return ("gate", "up")
    return ("all",)
