"""Whether a model fits before anything large exists: its config, the context length
served, the memory the runner would take (weights, KV cache, activations)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.kv_cache import KVCacheSpec
from inlinelm.gpu.loading.block_weights import BlockPlan
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.gpu.model_memory import check_model_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""torch dtypes by the names the config takes."""


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    """The context length served: the engine option, capped by the model's own limits."""
    limit = cfg.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(
            f"max_model_len {config.max_model_len} exceeds the model's limit {limit}",
            option="max_model_len",
        )
    return config.max_model_len


@dataclass(frozen=True, slots=True)
class ModelFit:
    """A model known to fit: its config, the context length served, and the KV cache's
    spec when its size is fixed before loading (None: a CUDA runner measures it later)."""

    model_config: ModelConfig
    max_model_len: int
    kv_spec: KVCacheSpec | None
    kv_dtype: torch.dtype


def check_model_fits(config: EngineConfig, folder: Path) -> ModelFit:
    """The model's checked config, served context length and up-front KV cache spec, once
    what the runner would allocate for them is known to fit this machine; reads
    config.json and the memory counters only, so it runs before anything large exists.

    Raises ``ModelLoadError`` for a bad config.json or a model too big for the memory
    (naming the field), ``ConfigError`` for an engine option that does not fit.
    """
    cfg = read_model_config(folder)
    max_model_len = resolve_max_model_len(config, cfg)
    dtype = DTYPES[config.model_dtype]
    blocks = planned_blocks(cfg, folder, config.weight_quantization, dtype)
    kv_dtype = kv_cache_dtype(config, dtype, blocks)
    kv_spec = check_model_memory(
        config, cfg, max_model_len, dtype, folder / "config.json", blocks, kv_dtype
    )
    return ModelFit(cfg, max_model_len, kv_spec, kv_dtype)


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, blocks: BlockPlan) -> torch.dtype:
    """The KV cache's dtype (``kv_cache_dtype``): as given; for ``"auto"`` float16 where
    a CPU model's linear layers keep block-quantized weights (``blocks`` is not empty),
    else the model's ``dtype``."""
    if config.kv_cache_dtype != "auto":
        return DTYPES[config.kv_cache_dtype]
    return torch.float16 if blocks and not config.device.startswith("cuda") else dtype


def planned_blocks(cfg: ModelConfig, folder: Path, mode: str, dtype: torch.dtype) -> BlockPlan:
    """The modules that will hold block-quantized weights and their kinds
    (``weights.block_plan``), from the config and the folder's recorded tensor types alone
    (a model on the meta device)."""
    if mode == "none":
        return {}
    from inlinelm.gpu.attention.torch_backend import TorchAttention
    from inlinelm.gpu.loading.weights import block_plan
    from inlinelm.gpu.model.registry import build_model

    with torch.device("meta"):
        backend = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        model = build_model(cfg, backend, 1, None)
    return block_plan(model.to(dtype=dtype), cfg, folder, mode)
