"""Gemma 3 (text): Gemma 2's layer without the soft caps (unless the config sets them),
per-head q/k norms, ``layer_types`` of sliding and full layers, the sliding layers rotated
with a RoPE base of their own, the full ones with the config's scaling."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models import gemma2
from inlinelm.gpu.model.models.family import Family
from inlinelm.gpu.model.rope import RopeConfig, parse_rope


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """See the module docstring."""
    cfg = gemma2.gemma_base(fields, cfg, default_pattern=6)
    global_rope, local_rope = _ropes(fields, cfg)
    layers = tuple(
        replace(spec, rope="local" if spec.attention.sliding_window is not None else "global")
        for spec in cfg.layers
    )
    return replace(cfg, qk_norm="head", rope=global_rope, local_rope=local_rope, layers=layers)


def _ropes(fields: ConfigFields, cfg: ModelConfig) -> tuple[RopeConfig, RopeConfig]:
    """The full layers' RoPE (the base config's) and the sliding layers': their own in
    ``rope_parameters`` (transformers 5), else the default at ``rope_local_base_freq``."""
    local = fields.table("rope_parameters").get("sliding_attention")
    if local is None:
        return cfg.rope, RopeConfig(theta=fields.positive_number("rope_local_base_freq", 10000.0))
    if not isinstance(local, dict):
        raise fields.error("rope_parameters.sliding_attention", "invalid RoPE settings (an object)")
    return cfg.rope, parse_rope(fields, table=local, source="rope_parameters.sliding_attention")


GEMMA3 = Family(
    name="Gemma 3",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    examples=("google/gemma-3-1b-it", "google/gemma-3-270m-it"),
    gguf="gemma3",
    model=gemma2.GemmaModel,
    configure=configure,
)
