"""Phi-3, Phi-3.5 and Phi-4-mini: Llama with the checkpoint's Q/K/V and gate/up already
fused, RoPE over the first ``partial_rotary_factor`` of each head (long-RoPE scaling comes
from the config's ``rope_scaling``), and a model-wide sliding window when set."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.family import Family


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """The rotated dimensions (even, at most the head)."""
    params = fields.table("rope_parameters")
    factor = fields.positive_number(
        "partial_rotary_factor", 1.0, params if "partial_rotary_factor" in params else None
    )
    rotary_dim = int(cfg.head_dim * factor)
    if factor > 1.0 or rotary_dim == 0 or rotary_dim % 2:
        raise fields.error(
            "partial_rotary_factor",
            f"partial_rotary_factor {factor} rotates {rotary_dim} of {cfg.head_dim} "
            "dimensions (an even number, at least 2)",
        )
    return replace(cfg, rotary_dim=rotary_dim)


PHI3 = Family(
    name="Phi-3 / Phi-4-mini",
    model_types=("phi3",),
    architectures=("Phi3ForCausalLM",),
    examples=("microsoft/Phi-3.5-mini-instruct", "microsoft/Phi-4-mini-instruct"),
    gguf="phi3",
    configure=configure,
    model_wide_window=True,
)
