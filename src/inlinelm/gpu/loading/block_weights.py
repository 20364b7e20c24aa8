"""Block-quantized weights while loading: which modules keep them and in which kind
(:func:`choose`), their tiles made before the float parameters (:func:`allocate`), and each
checkpoint tensor packed into them, quantized, or dequantized for a float module
(:func:`fill`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.model_files import WEIGHT_INDEX, weight_files
from inlinelm.gpu.loading.quantization import (
    BLOCKS_METADATA,
    module_kind,
    quantized_modules,
)
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.layers.blocks import (
    BLOCK,
    BLOCK_BYTES,
    BlockWeight,
    can_quantize,
    dequantize_blocks,
    quantize_q8_0,
)
from inlinelm.gpu.model.layers.embedding import Embedding
from inlinelm.gpu.model.layers.linear import Linear
from inlinelm.gpu.model.models.decoder import DecoderModel

logger = logging.getLogger(__name__)

BlockPlan = Mapping[str, str]
"""The modules that keep block-quantized weights (linear layers, and ``"embed_tokens"``)
and the block kind of each (``"Q4_1"``, ...)."""


def choose(
    model: DecoderModel,
    mode: str,
    sources: Mapping[str, list[str]],
    types: Mapping[str, str],
    blocks: Mapping[str, str],
) -> BlockPlan:
    """The modules of ``model`` that keep block-quantized weights under ``mode``
    (:func:`~inlinelm.gpu.loading.quantization.quantized_modules`: ``sources`` names the
    checkpoint weights of each module, ``types`` their stored GGUF types) and their kinds
    (:func:`~inlinelm.gpu.loading.quantization.module_kind` of the checkpoint's
    ``blocks``); none where the CPU kernel did not build, and no module whose rows do not
    split into blocks. A tied LM head is made of the embedding: the two are quantized
    together, and share one copy."""
    if mode == "none":
        return {}
    if cpu_extension() is None:
        logger.warning("quantized weights need the CPU extension, which did not build: float")
        return {}
    cfg = model.config
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    sources = dict(sources)
    if cfg.tie_word_embeddings:
        sources["lm_head"] = sources.get("embed_tokens", [])
    widths = {name: m.weight_t.shape[0] for name, m in modules.items()}
    widths["embed_tokens"] = cfg.hidden_size
    chosen = {
        name
        for name in quantized_modules(mode, [*modules, "embed_tokens"], sources, types)
        if can_quantize(widths[name])
    }
    # NOTE: both are hidden_size wide, so one chosen means both can be
    if cfg.tie_word_embeddings and ("lm_head" in chosen) != ("embed_tokens" in chosen):
        chosen |= {"lm_head", "embed_tokens"}
    return {name: module_kind(sources.get(name, []), blocks) for name in sorted(chosen)}


def allocate(model: DecoderModel, plan: BlockPlan, device: torch.device) -> None:
    """Give the modules of ``plan`` their (zero) tiles on ``device``, before the float
    parameters are allocated (theirs then take no memory)."""
    modules = dict(model.named_modules())
    for name, kind in plan.items():
        if name == "lm_head" and model.config.tie_word_embeddings:
            continue
        module = modules[name]
        rows, cols = (
            module.weight.shape if isinstance(module, Embedding) else module.weight_t.T.shape
        )
        module.use_blocks(BlockWeight.empty(kind, rows, cols, device))
    embedding = model.embed_tokens.blocks
    if "lm_head" in plan and model.config.tie_word_embeddings:
        assert embedding is not None, "a tied head is quantized with its embedding"
        model.lm_head.use_blocks(embedding)


@dataclass(frozen=True, slots=True)
class BlockRows:
    """Rows ``[start, stop)`` of a module's block-quantized weight (a fused module's part,
    or all of it): a loading destination, filled by :func:`fill`."""

    weight: BlockWeight
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.stop - self.start, self.weight.cols

    def __getitem__(self, rows: slice) -> BlockRows:
        start, stop, _ = rows.indices(self.stop - self.start)
        return BlockRows(self.weight, self.start + start, self.start + stop)


def fill(dest: torch.Tensor | BlockRows, tensor: torch.Tensor, kind: str | None) -> None:
    """Copy a checkpoint tensor (float, or GGUF blocks of ``kind``) into ``dest``: packed
    as they are when ``dest`` has their kind, else through their values (quantized to Q8_0
    for a block destination, dequantized for a float one)."""
    if not isinstance(dest, BlockRows):
        dest.copy_(tensor if kind is None else dequantize_blocks(tensor, kind))
        return
    if kind != dest.weight.kind:
        # NOTE: the plan gives a module a Q4 kind only where all its sources hold it
        assert dest.weight.kind == "Q8_0", "a Q4 module is filled from its own blocks"
        values = tensor if kind is None else dequantize_blocks(tensor, kind)
        tensor = quantize_q8_0(values)
    dest.weight.pack(dest.start, tensor)


def blocks_of(module: torch.nn.Module) -> BlockWeight | None:
    if isinstance(module, Linear | Embedding):
        return module.blocks
    return None


def stored_blocks(folder: Path) -> dict[str, str]:
    """The block kind of each block-quantized tensor of ``folder``'s checkpoint (from its
    shards' headers alone; {} for a folder with no weight files, whose loading names what
    is missing)."""
    from safetensors import SafetensorError, safe_open

    if not ((folder / WEIGHT_INDEX).is_file() or any(folder.glob("*.safetensors"))):
        return {}
    kinds: dict[str, str] = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                kinds.update(block_kinds(f.metadata(), path))
        except (SafetensorError, OSError) as e:  # NOTE: the boundary of the file read
            raise ModelLoadError(f"unreadable safetensors header ({e})", path=str(path)) from e
    return kinds


def block_kinds(metadata: Mapping[str, str] | None, path: Path) -> dict[str, str]:
    """The block kind of each block-quantized tensor of a shard, from its metadata
    (:data:`~inlinelm.gpu.loading.quantization.BLOCKS_METADATA`)."""
    raw = (metadata or {}).get(BLOCKS_METADATA)
    if raw is None:
        return {}
    try:
        kinds = json.loads(raw)
    except ValueError as e:
        raise ModelLoadError(f"unreadable {BLOCKS_METADATA} metadata ({e})", path=str(path)) from e
    if not isinstance(kinds, dict) or not all(k in BLOCK_BYTES for k in kinds.values()):
        raise ModelLoadError(
            f"{BLOCKS_METADATA} must map tensor names to one of {sorted(BLOCK_BYTES)}",
            path=str(path),
        )
    return kinds


def check_blocks(
    kind: str | None, shape: tuple[int, ...], dest_shape: tuple[int, int], path: Path, name: str
) -> None:
    """A ``U8`` checkpoint tensor is the blocks of its kind, as many as ``dest_shape``'s
    weights take (``ModelLoadError`` otherwise)."""
    if kind is None:
        raise ModelLoadError(
            f"a U8 tensor is a block-quantized weight only with its kind in the shard's "
            f"{BLOCKS_METADATA} metadata",
            path=str(path),
            field=name,
        )
    rows, cols = dest_shape
    want = (rows, cols // BLOCK * BLOCK_BYTES[kind])
    if cols % BLOCK or tuple(shape) != want:
        raise ModelLoadError(
            f"{kind} blocks of a {tuple(dest_shape)} weight are U8 {want}; file has {shape}",
            path=str(path),
            field=name,
        )
