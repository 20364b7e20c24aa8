"""Qwen3: Llama with an RMSNorm on each query and key head, no Q/K/V bias by default."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.family import Family


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """Per-head q/k norms (the explicit ``head_dim`` is read by the base config)."""
    return replace(cfg, qk_norm="head")


QWEN3 = Family(
    name="Qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    examples=("Qwen/Qwen3-0.6B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B"),
    gguf="qwen3",
    configure=configure,
)
