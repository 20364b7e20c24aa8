"""Mixtral: Mistral whose every MLP is a sparse mixture of experts (top-k renormalised)."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig, MoEConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.family import Family
from inlinelm.gpu.model.models.qwen3_moe import all_sparse, experts_per_token


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """``num_local_experts`` experts of ``intermediate_size`` in every layer."""
    num_experts = fields.positive_int("num_local_experts")
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=experts_per_token(fields, num_experts),
        intermediate_size=cfg.intermediate_size,
        renormalize=True,
    )
    return replace(cfg, moe=moe, layers=all_sparse(cfg))


MIXTRAL = Family(
    name="Mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM",),
    examples=("mistralai/Mixtral-8x7B-Instruct-v0.1",),
    gguf="llama",
    configure=configure,
    model_wide_window=True,
    checkpoint_names=(
        (r"^block_sparse_moe\.", "mlp."),
        (r"\.w1\.weight$", ".gate_proj.weight"),
        (r"\.w3\.weight$", ".up_proj.weight"),
        (r"\.w2\.weight$", ".down_proj.weight"),
    ),
)
