"""Granite: Llama with multipliers on the embeddings, each block's residual add and the
attention scores, and logits divided by ``logits_scaling``."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.family import Family


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """The four multipliers (each 1 when absent, as in transformers' config)."""
    scale = fields.positive_number("attention_multiplier", 1.0)
    layers = tuple(
        replace(spec, attention=replace(spec.attention, scale=scale)) for spec in cfg.layers
    )
    return replace(
        cfg,
        layers=layers,
        embedding_scale=fields.positive_number("embedding_multiplier", 1.0),
        residual_scale=fields.positive_number("residual_multiplier", 1.0),
        logits_divisor=fields.positive_number("logits_scaling", 1.0),
    )


GRANITE = Family(
    name="Granite",
    model_types=("granite",),
    architectures=("GraniteForCausalLM",),
    examples=("ibm-granite/granite-3.3-2b-instruct", "ibm-granite/granite-3.3-8b-instruct"),
    gguf="granite",
    configure=configure,
)
