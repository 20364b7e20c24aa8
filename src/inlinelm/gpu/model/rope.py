"""Rotary position embeddings: the settings a config.json gives, and the cos/sin table.

``RopeConfig`` is what :func:`parse_rope` reads from ``rope_parameters`` (transformers 5)
or ``rope_theta`` and ``rope_scaling`` (older configs); :func:`cos_sin_cache` turns it into
the table every layer reads, one row per position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inlinelm.gpu.model.fields import ConfigFields, show

_SUPPORTED_ROPE = ("default", "llama3")
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings; ``rope_type`` is ``default`` or ``llama3``."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def parse_rope(fields: ConfigFields) -> RopeConfig:
    # transformers 5 writes rope_parameters; older configs write rope_theta + rope_scaling.
    source = "rope_parameters" if fields.raw.get("rope_parameters") else "rope_scaling"
    merged = {**fields.table("rope_scaling"), **fields.table("rope_parameters")}
    theta_table = merged if "rope_theta" in merged else None
    theta = fields.positive_number("rope_theta", 10000.0, theta_table)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE:
        raise fields.error(
            source,
            f"unsupported RoPE scaling type {show(rope_type)}; supported: {', '.join(_SUPPORTED_ROPE)}",
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    for key in _LLAMA3_ROPE_KEYS:
        if key not in merged:
            raise fields.error(f"{source}.{key}", f"llama3 RoPE scaling needs {key}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=fields.positive_number("factor", 1.0, merged),
        low_freq_factor=fields.positive_number("low_freq_factor", 1.0, merged),
        high_freq_factor=fields.positive_number("high_freq_factor", 4.0, merged),
        original_max_position_embeddings=int(
            fields.positive_number("original_max_position_embeddings", 8192, merged)
        ),
    )


def cos_sin_cache(rope: RopeConfig, rotary_dim: int, max_positions: int) -> torch.Tensor:
    """The [max_positions, rotary_dim] float32 table of ``rope``: the cosines of the
    ``rotary_dim / 2`` frequencies at each position, then their sines (FlashInfer's
    layout, which :class:`~inlinelm.gpu.model.kernels.RopeInputs` describes)."""
    inv_freq = _inv_freq(rope, rotary_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
