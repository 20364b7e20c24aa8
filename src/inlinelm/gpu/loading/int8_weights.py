"""Int8 weights while loading: which modules keep them (:func:`choose`), their buffers made
before the float parameters (:func:`allocate`), and each checkpoint tensor copied into
them, quantized, or dequantized for a float module (:func:`fill`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.quantization import INT8_SCALE, int8_modules, scale_groups
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.layers.embedding import Embedding
from inlinelm.gpu.model.layers.int8 import dequantize, quantize_groups
from inlinelm.gpu.model.layers.linear import Linear
from inlinelm.gpu.model.models.decoder import DecoderModel

logger = logging.getLogger(__name__)

GROUP_MULTIPLE = 16
"""A scale group's size must be a multiple of this (the int8 kernel's widest vector)."""

Int8Plan = Mapping[str, int]
"""The modules that keep int8 weights (linear layers, and ``"embed_tokens"``) and the scale
groups per row of each (1: a scale per row; a Q8_0 file's modules: one per 32-weight
block)."""


def choose(
    model: DecoderModel, mode: str, sources: Mapping[str, list[str]], types: Mapping[str, str]
) -> Int8Plan:
    """The modules of ``model`` that keep int8 weights under ``mode``
    (:func:`~inlinelm.gpu.loading.quantization.int8_modules`: ``sources`` names the
    checkpoint weights of each module, ``types`` their stored GGUF types) and their scale
    groups (:func:`~inlinelm.gpu.loading.quantization.scale_groups`); none where the CPU
    kernel did not build. A tied LM head is made of the embedding: the two are int8
    together, and share one copy."""
    if mode == "none":
        return {}
    if cpu_extension() is None:
        logger.warning("int8 weights need the CPU extension, which did not build: float")
        return {}
    cfg = model.config
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    sources = dict(sources)
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


def allocate(model: DecoderModel, int8: Int8Plan, device: torch.device) -> None:
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
class Int8Rows:
    """The int8 weights of a module (or the rows a fused one takes from a checkpoint
    tensor) and their scales: a loading destination, filled by :func:`fill`."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, rows: slice) -> Int8Rows:
        return Int8Rows(self.q[rows], self.scale[rows])


def fill(dest: torch.Tensor | Int8Rows, tensor: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Copy a checkpoint tensor (float, or int8 rows with their ``scale``) into ``dest``:
    quantized for an int8 destination (with its scale groups), dequantized for a float
    one."""
    if not isinstance(dest, Int8Rows):
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


def int8_of(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(module, Linear):
        return module.int8
    if isinstance(module, Embedding):
        return module.int8
    return None


def read_scale(
    f: Any, names: set[str], name: str, shape: tuple[int, ...], path: Path
) -> torch.Tensor:
    """The float32 scales ([rows], or [rows, groups]) of the int8 tensor ``name``
    (``ModelLoadError`` when they are missing or misshapen: an int8 tensor is ours only
    with them)."""
    scale_name = name + INT8_SCALE
    if len(shape) != 2 or scale_name not in names:
        raise ModelLoadError(
            f"an int8 tensor needs a 2-D shape and its float32 scales {scale_name}",
            path=str(path),
            field=name,
        )
    header = f.get_slice(scale_name)
    scale_shape = tuple(header.get_shape())
    # NOTE: groups of a multiple of 16 weights (the kernel's vector), as a Q8_0 file's 32
    grouped = (
        len(scale_shape) == 2
        and scale_shape[1] >= 1
        and shape[1] % scale_shape[1] == 0
        and (shape[1] // scale_shape[1]) % GROUP_MULTIPLE == 0
    )
    if (
        header.get_dtype() != "F32"
        or scale_shape[:1] != shape[:1]
        or not (len(scale_shape) == 1 or grouped)
    ):
        raise ModelLoadError(
            f"int8 scales must be F32 of shape {shape[:1]}, or {shape[:1]} + (groups,) with "
            f"groups of a multiple of {GROUP_MULTIPLE} weights; file has {header.get_dtype()} "
            f"{scale_shape}",
            path=str(path),
            field=scale_name,
        )
    scale: torch.Tensor = f.get_tensor(scale_name)
    return scale
