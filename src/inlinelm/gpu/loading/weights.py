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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.attention.metadata import AttentionBackend
from inlinelm.gpu.loading.model_files import weight_files
from inlinelm.gpu.loading.quantization import INT8_SCALE, int8_modules, scale_groups, stored_types
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.layers.embedding import Embedding
from inlinelm.gpu.model.layers.int8 import dequantize, quantize_groups
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
    keep int8 weights (:func:`int8_plan`). Those never hold their float weights: each
    checkpoint tensor is quantized as it is read (or copied, when the folder holds it as
    int8 already: a GGUF file's int8 conversion), so the weights take their int8 bytes
    plus one float tensor at a time.

    Raises ``ModelLoadError`` naming the file and tensor for unreadable or truncated
    files, shape mismatches, non-float tensors (both checked from the header, before the
    tensor is read) and missing tensors; nothing half-loaded is returned. Whether the model
    fits in memory is the caller's check (``model_memory``), made before this allocates.
    """
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_model(cfg, backend, 1, kernels)
    model = model.to(dtype=dtype)
    int8 = int8_plan(model, cfg, folder, quantization)
    _allocate_int8(model, int8, device)
    model = model.to_empty(device=device)
    model.set_max_positions(max_positions)
    params = _destinations(model)
    loaded = _load_files(folder, cfg, params)
    _check_complete(folder, cfg, params, loaded)
    if cfg.tie_word_embeddings and not model.lm_head.is_int8:
        model.lm_head.weight_t.data.copy_(model.embed_tokens.weight.data.t())
    linears = sum(isinstance(m, Linear) for m in model.modules())
    logger.info(
        "int8 weights in %d of %d linear layers", len(set(int8) - {"embed_tokens"}), linears
    )
    if onednn_packing_available(device, dtype):
        _pack_for_onednn(model)
    logger.info("loaded %s weights in %.2f s", folder.name, time.perf_counter() - start)
    # NOTE: inference only: no parameter asks autograd to record (a graph capture outside
    # inference mode would otherwise trip over the in-place KV-cache writes).
    model.requires_grad_(False)
    return model.eval()


Int8Plan = Mapping[str, int]
"""The modules that keep int8 weights (linear layers, and ``"embed_tokens"``) and the scale
groups per row of each (1: a scale per row; a Q8_0 file's modules: one per 32-weight
block)."""


def int8_plan(model: DecoderModel, cfg: ModelConfig, folder: Path, mode: str) -> Int8Plan:
    """The :data:`Int8Plan` of ``model`` under ``mode``
    (:func:`~inlinelm.gpu.loading.quantization.int8_modules`,
    :func:`~inlinelm.gpu.loading.quantization.scale_groups`); empty where the CPU kernel did
    not build. A tied LM head is made of the embedding: the two are int8 together, and
    share one copy."""
    if mode == "none":
        return {}
    if cpu_extension() is None:
        logger.warning("int8 weights need the CPU extension, which did not build: float")
        return {}
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    sources: dict[str, list[str]] = {}
    types = stored_types(folder)
    for name in types:
        target = _target(name, cfg)
        if target is not None and target.param.endswith(".weight"):
            sources.setdefault(target.param.removesuffix(".weight"), []).append(name)
    if cfg.tie_word_embeddings:
        sources["lm_head"] = sources.get("embed_tokens", [])
    chosen = set(int8_modules(mode, [*modules, "embed_tokens"], sources, types))
    if cfg.tie_word_embeddings and ("lm_head" in chosen) != ("embed_tokens" in chosen):
        chosen |= {"lm_head", "embed_tokens"}
    widths = {name: m.weight_t.shape[0] for name, m in modules.items()}
    widths["embed_tokens"] = cfg.hidden_size
    return {
        name: scale_groups(sources.get(name, []), types, widths[name]) for name in sorted(chosen)
    }


def _allocate_int8(model: DecoderModel, int8: Int8Plan, device: torch.device) -> None:
    """Give the modules of ``int8`` their (unfilled) int8 weights and scales on ``device``,
    before the float parameters are allocated (theirs then take no memory)."""
    modules = dict(model.named_modules())
    for name, groups in int8.items():
        if name == "lm_head" and model.config.tie_word_embeddings:
            continue
        module = modules[name]
        rows, cols = (
            module.weight.shape if isinstance(module, Embedding) else module.weight_t.T.shape
        )
        q = torch.empty(rows, cols, dtype=torch.int8, device=device)
        shape = (rows,) if groups == 1 else (rows, groups)
        module.use_int8(q, torch.empty(shape, dtype=torch.float32, device=device))
    embedding = model.embed_tokens.int8
    if "lm_head" in int8 and model.config.tie_word_embeddings:
        assert embedding is not None, "a tied head is int8 with its embedding"
        model.lm_head.use_int8(*embedding)


@dataclass(frozen=True, slots=True)
class _Int8Rows:
    """The int8 weights of a module (or the rows a fused one takes from a checkpoint
    tensor) and their scales: a loading destination, filled by :func:`_fill`."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, rows: slice) -> _Int8Rows:
        return _Int8Rows(self.q[rows], self.scale[rows])


def _fill(dest: torch.Tensor | _Int8Rows, tensor: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Copy a checkpoint tensor (float, or int8 rows with their ``scale``) into ``dest``:
    quantized for an int8 destination (with its scale groups), dequantized for a float
    one."""
    if not isinstance(dest, _Int8Rows):
        dest.copy_(tensor if scale is None else dequantize(tensor, scale))
        return
    groups = 1 if dest.scale.dim() == 1 else dest.scale.shape[1]
    if scale is None or (scale.dim() == 2 and scale.shape[1] != groups):
        source = tensor if scale is None else dequantize(tensor, scale)
        tensor, scale = quantize_groups(source, groups)
    dest.q.copy_(tensor)
    # NOTE: a scale per row fills a module of groups as that scale in each of its groups
    dest.scale.copy_(
        scale if scale.dim() == dest.scale.dim() else scale[:, None].expand_as(dest.scale)
    )


def _pack_for_onednn(model: DecoderModel) -> None:
    """Pack every float linear layer for oneDNN; stop at the first that refuses."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not module.is_int8 and not module.pack_for_onednn():
            logger.warning("oneDNN packing refused at %s: plain matmuls from there on", name)
            return


def _destinations(model: DecoderModel) -> dict[str, torch.Tensor | _Int8Rows]:
    """Every loadable tensor under its checkpoint-style name, in the checkpoint's orientation
    (a ``Linear``'s transposed storage is exposed as a ``.weight`` view of shape [out, in],
    an int8 module's weights as :class:`_Int8Rows`; the experts of a sparse MLP by their
    per-expert names)."""
    views: dict[str, torch.Tensor | _Int8Rows] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        int8 = _int8_of(module)
        if isinstance(module, SparseMoE):
            views.update({f"{prefix}{k}": v for k, v in module.expert_weights().items()})
        elif int8 is not None:
            views[f"{prefix}weight"] = _Int8Rows(*int8)
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


def _int8_of(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(module, Linear):
        return module.int8
    if isinstance(module, Embedding):
        return module.int8
    return None


def _load_files(
    folder: Path, cfg: ModelConfig, params: dict[str, torch.Tensor | _Int8Rows]
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
    params: dict[str, torch.Tensor | _Int8Rows],
    loaded: set[_Target],
    bar: Any,
) -> int:
    """Copy the tensors of one file into ``params`` (adding them to ``loaded``), advancing
    ``bar`` by each tensor's bytes; returns the bytes counted. Each tensor's dtype and
    shape are checked from the header before its data is read. An int8 tensor (``I8``) is
    read with its scales, the float32 tensor of the same name plus ``_scale``."""
    from safetensors import safe_open

    num_bytes = 0
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if name.endswith(INT8_SCALE) and name.removesuffix(INT8_SCALE) in names:
                continue  # read with its weight
            target = _target(name, cfg)
            if target is None:
                continue
            header = f.get_slice(name)
            dest = _destination(target, params, cfg, path, name)
            shape = tuple(header.get_shape())
            _check_header(header.get_dtype(), shape, dest, path, name, name + INT8_SCALE in names)
            scale = None
            if header.get_dtype() == "I8":
                scale = _int8_scale(f, names, name, shape, path)
            tensor = f.get_tensor(name)
            _fill(dest, tensor, scale)
            loaded.add(target)
            size = tensor.numel() * tensor.element_size() + (
                0 if scale is None else scale.numel() * 4
            )
            bar.update(size)
            num_bytes += size
    return num_bytes


def _int8_scale(
    f: Any, names: set[str], name: str, shape: tuple[int, ...], path: Path
) -> torch.Tensor:
    """The float32 scales [rows] of the int8 tensor ``name`` (``ModelLoadError`` when they
    are missing or misshapen: an int8 tensor is ours only with them)."""
    scale_name = name + INT8_SCALE
    if len(shape) != 2 or scale_name not in names:
        raise ModelLoadError(
            f"an int8 tensor needs a 2-D shape and its float32 scales {scale_name}",
            path=str(path),
            field=name,
        )
    header = f.get_slice(scale_name)
    scale_shape = tuple(header.get_shape())
    grouped = len(scale_shape) == 2 and scale_shape[1] >= 1 and shape[1] % scale_shape[1] == 0
    if (
        header.get_dtype() != "F32"
        or scale_shape[:1] != shape[:1]
        or not (len(scale_shape) == 1 or grouped)
    ):
        raise ModelLoadError(
            f"int8 scales must be F32 of shape {shape[:1]} or {shape[:1]} + (groups,), file has "
            f"{header.get_dtype()} {scale_shape}",
            path=str(path),
            field=scale_name,
        )
    scale: torch.Tensor = f.get_tensor(scale_name)
    return scale


def _target(name: str, cfg: ModelConfig) -> _Target | None:
    """Map a Hugging Face tensor name to our parameter and shard (None: not ours to load)."""
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
    params: dict[str, torch.Tensor | _Int8Rows],
    cfg: ModelConfig,
    path: Path,
    name: str,
) -> torch.Tensor | _Int8Rows:
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
    dest: torch.Tensor | _Int8Rows,
    path: Path,
    name: str,
    has_scale: bool,
) -> None:
    """A checkpoint tensor's header entry against the parameter it fills (int8 only with
    its scales: they are checked with it)."""
    if dtype not in _FLOAT_DTYPES and not (dtype == "I8" and has_scale):
        raise ModelLoadError(
            f"unsupported weight dtype {dtype} (supported: {', '.join(_FLOAT_DTYPES)}, and I8 "
            f"with its float32 scales as {name}{INT8_SCALE})",
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
    params: dict[str, torch.Tensor | _Int8Rows],
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
