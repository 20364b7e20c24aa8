"""SmolLM3: Llama without RoPE on every ``no_rope_layer_interval``-th layer."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.family import Family


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """Which layers rotate: ``no_rope_layers`` (1: RoPE, 0: none) when given, else all
    but every ``no_rope_layer_interval``-th (4 by default)."""
    interval = fields.positive_int("no_rope_layer_interval", 4)
    default = tuple(int((i + 1) % interval != 0) for i in range(cfg.num_layers))
    uses_rope = fields.int_list("no_rope_layers", default)
    if len(uses_rope) != cfg.num_layers or any(flag > 1 for flag in uses_rope):
        raise fields.error(
            "no_rope_layers", f"no_rope_layers needs a 0 or 1 for each of {cfg.num_layers} layers"
        )
    layers = tuple(
        replace(spec, rope="global" if flag else None)
        for spec, flag in zip(cfg.layers, uses_rope, strict=True)
    )
    return replace(cfg, layers=layers)


SMOLLM3 = Family(
    name="SmolLM3",
    model_types=("smollm3",),
    architectures=("SmolLM3ForCausalLM",),
    examples=("HuggingFaceTB/SmolLM3-3B",),
    gguf=None,
    configure=configure,
)
