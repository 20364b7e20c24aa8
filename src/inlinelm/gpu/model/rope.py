"""Rotary position embeddings: the settings a config.json gives, and the cos/sin table.

``RopeConfig`` is what :func:`parse_rope` reads from ``rope_parameters`` (transformers 5),
``rope_theta`` and ``rope_scaling`` (older configs), or one per-layer-type table of them;
:func:`cos_sin_cache` turns it into the table every layer reads, one row per position.

The types are transformers 5.24's (``modeling_rope_utils``): ``default``, ``linear``,
``dynamic``, ``yarn``, ``llama3`` and ``longrope``, each computed with the float32 operations
transformers runs, in its order, so the table is the cos and sin of its rotary embedding
(tests/gpu/model/test_rope.py compares them). Yarn and longrope scale attention: their cos
and sin come multiplied by the attention factor, as transformers returns them.

Dynamic and longrope depend on the sequence: transformers recomputes the frequencies at each
forward from ``seq_len = max(position_ids) + 1``. A table must not depend on the batch, so
row ``p`` holds what transformers computes for a forward whose largest position is ``p``:
dynamic's base grows with ``p + 1`` once that passes ``max_position_embeddings``; longrope
takes its short factors below ``original_max_position_embeddings`` and its long ones from
there on. For dynamic that is transformers exactly when decoding one token at a time, and
for any forward that stays below the original length; one forward that crosses it (a prompt
prefilled in one go) differs: transformers rotates every token of it with the frequencies of
its last position, we rotate each token with its own. (Transformers' dynamic type also keeps
a grown base for a later, shorter forward past the original length; ours does not.)

Longrope matches transformers' Phi-3 exactly: a sequence longer than the original length
rotates every position with the long factors (its Phi-3 drops its cache the first time a
sequence passes that length and encodes it again). A longrope table therefore has
``original_max_position_embeddings`` more rows after the ``max_positions`` ones: positions
``0 ..`` with the long factors, which a sequence past :func:`long_context_from` reads
(:meth:`~inlinelm.gpu.input_batch.InputBatch.prepare` picks the rows; the scheduler
recomputes a sequence the step it crosses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.model.fields import ConfigFields, show

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """The rotary settings of one layer type, with every default transformers derives
    (yarn's and longrope's factor and attention factor) filled in.

    ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`. ``original_max_position_embeddings``
    is the length the scaling starts from (for ``dynamic``, the config's
    ``max_position_embeddings``, the length transformers reads). ``attention_factor``
    multiplies cos and sin. ``source`` names the config field the settings came from, for
    errors found later (see :func:`check_rotary_dim`).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    source: str = field(default="rope_parameters", compare=False)


def parse_rope(
    fields: ConfigFields, table: dict[str, Any] | None = None, source: str | None = None
) -> RopeConfig:
    """Read and check the RoPE settings of a config.

    Reads ``table`` when given (one layer type's settings, such as Gemma 3's
    ``rope_parameters["full_attention"]``), else ``rope_parameters`` merged over
    ``rope_scaling``. ``rope_theta`` falls back to the top-level field, then 10000.
    ``source`` is the field name errors give (default: the top-level table read).
    Raises ``ModelLoadError`` naming the field: an unknown type, a missing key, a value
    that is not a positive finite number, a factor list that is not a list of them.
    """
    if table is None:
        source = source or (
            "rope_parameters" if fields.raw.get("rope_parameters") else "rope_scaling"
        )
        merged = {**fields.table("rope_scaling"), **fields.table("rope_parameters")}
        reader = _Table(fields, merged, source, top_level=True)
    else:
        reader = _Table(fields, table, source or "rope_parameters", top_level=False)
    reader.reject_nested()
    rope_type = reader.table.get("rope_type", reader.table.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise reader.error(
            "rope_type",
            f"unsupported RoPE type {show(rope_type)}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    theta = reader.number("rope_theta") or fields.positive_number("rope_theta", 10000.0)
    base = RopeConfig(theta=theta, rope_type=rope_type, source=reader.source)
    return _BUILDERS[rope_type](reader, base)


def check_rotary_dim(rope: RopeConfig, rotary_dim: int, path: str | None = None) -> None:
    """Raise ``ModelLoadError`` (naming ``path`` and the field) if ``rope`` cannot rotate
    ``rotary_dim`` dimensions: longrope's factor lists need ``rotary_dim / 2`` entries, and
    dynamic's exponent ``d / (d - 2)`` a dimension above 2. ``rotary_dim`` must be even."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if rope.rope_type == "dynamic" and rotary_dim == 2:
        raise ModelLoadError(
            "dynamic RoPE needs a rotary dimension above 2", path=path, field=rope.source
        )
    if rope.rope_type != "longrope":
        return
    for name, factors in (("short_factor", rope.short_factor), ("long_factor", rope.long_factor)):
        if len(factors) != rotary_dim // 2:
            raise ModelLoadError(
                f"longrope {name} has {len(factors)} entries; a rotary dimension of "
                f"{rotary_dim} needs {rotary_dim // 2}",
                path=path,
                field=f"{rope.source}.{name}",
            )


def cos_sin_cache(rope: RopeConfig, rotary_dim: int, max_positions: int) -> torch.Tensor:
    """The [rows, rotary_dim] float32 table of ``rope``: the cosines of the ``rotary_dim /
    2`` frequencies at each position, then their sines (FlashInfer's layout, which
    :class:`~inlinelm.gpu.model.kernels.RopeInputs` describes), both times the attention
    factor. ``rows`` is ``max_positions``, and for longrope up to
    ``original_max_position_embeddings`` more: its first positions with the long factors
    (see the module's doc). Raises as :func:`check_rotary_dim` does."""
    check_rotary_dim(rope, rotary_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * _inv_freq(rope, rotary_dim, max_positions)
    if long_context_from(rope) is not None:
        first = positions[: rope.original_max_position_embeddings]
        freqs = torch.cat((freqs, first[:, None] * _longrope_inv_freq(rope, rotary_dim)[1]))
    # NOTE: transformers scales cos and sin after computing them (x 1.0 is exact).
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope.attention_factor


def long_context_from(rope: RopeConfig) -> int | None:
    """The length past which every position of a sequence rotates differently, so a sequence
    that grows past it is encoded again from its first token: longrope's original length
    (None for the other types)."""
    return rope.original_max_position_embeddings if rope.rope_type == "longrope" else None


class _Table:
    """Typed reads of one RoPE table; each error names ``source.key``."""

    def __init__(
        self, fields: ConfigFields, table: dict[str, Any], source: str, *, top_level: bool
    ) -> None:
        self.fields = fields
        self.table = table
        self.source = source
        self.top_level = top_level

    def error(self, key: str, message: str) -> ModelLoadError:
        return self.fields.error(f"{self.source}.{key}", message)

    def reject_nested(self) -> None:
        # NOTE: read flat, Gemma 3's per-layer-type tables would silently be a default RoPE.
        nested = [key for key, value in self.table.items() if isinstance(value, dict)]
        if nested:
            raise self.error(
                nested[0], "RoPE settings per layer type, which this model does not read"
            )

    def number(self, key: str, *, zero_ok: bool = False) -> float | None:
        """A positive (or, with ``zero_ok``, non-negative) finite number; None if absent."""
        value = self.table.get(key)
        number = _finite(value)
        if value is not None and (number is None or number < 0 or (number == 0 and not zero_ok)):
            kind = "a number >= 0" if zero_ok else "a positive number"
            raise self.error(key, f"invalid {key}: {show(value)} ({kind})")
        return number

    def required(self, key: str, rope_type: str) -> float:
        value = self.number(key)
        if value is None:
            raise self.error(key, f"{rope_type} RoPE needs {key}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.table.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"invalid {key}: {show(value)} (true or false)")
        return value

    def factors(self, key: str) -> tuple[float, ...]:
        value = self.table.get(key)
        if value is None:
            raise self.error(key, f"longrope RoPE needs {key}")
        numbers = [_finite(v) for v in value] if isinstance(value, list) else [None]
        if not numbers or any(n is None or n <= 0 for n in numbers):
            raise self.error(key, f"invalid {key}: {show(value)} (a list of positive numbers)")
        return tuple(n for n in numbers if n is not None)

    def original_length(self) -> int:
        """``original_max_position_embeddings``: the table's, else (Phi-3 writes it there)
        the top-level one, else ``max_position_embeddings``, as transformers defaults it.
        (Transformers' Phi-3 class prefers the top-level one when both exist; no config
        we know writes both.)"""
        key = "original_max_position_embeddings"
        value = self.table.get(key)
        if value is None and self.top_level and self.fields.raw.get(key) is not None:
            return self.fields.positive_int(key)
        if value is None:
            return self.max_length()
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self.error(key, f"invalid {key}: {show(value)} (a positive integer)")
        return value

    def max_length(self) -> int:
        return self.fields.positive_int("max_position_embeddings")


def _finite(value: object) -> float | None:
    """``value`` as a float if it is a finite JSON number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past float range
        return None
    return number if math.isfinite(number) else None


def _linear(reader: _Table, base: RopeConfig) -> RopeConfig:
    return replace(base, factor=reader.required("factor", "linear"))


def _dynamic(reader: _Table, base: RopeConfig) -> RopeConfig:
    # NOTE: transformers' dynamic type grows past max_position_embeddings, not an original length.
    factor = reader.required("factor", "dynamic")
    return replace(base, factor=factor, original_max_position_embeddings=reader.max_length())


def _llama3(reader: _Table, base: RopeConfig) -> RopeConfig:
    low = reader.required("low_freq_factor", "llama3")
    high = reader.required("high_freq_factor", "llama3")
    if high <= low:
        raise reader.error(
            "high_freq_factor", f"high_freq_factor {high} must exceed low_freq_factor {low}"
        )
    return replace(
        base,
        factor=reader.required("factor", "llama3"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=reader.original_length(),
    )


def _yarn(reader: _Table, base: RopeConfig) -> RopeConfig:
    if base.theta <= 1:
        raise reader.error("rope_theta", f"yarn RoPE needs rope_theta above 1, got {base.theta}")
    original = reader.original_length()
    # DeepSeek-V3 leaves factor out: the ratio of the context lengths is the factor.
    factor = reader.number("factor") or reader.max_length() / original
    mscale = reader.number("mscale", zero_ok=True)
    mscale_all_dim = reader.number("mscale_all_dim", zero_ok=True)
    attention = reader.number("attention_factor")
    if attention is None and mscale and mscale_all_dim:
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return replace(
        base,
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention or _yarn_mscale(factor, 1.0),
        beta_fast=reader.number("beta_fast") or 32.0,
        beta_slow=reader.number("beta_slow") or 1.0,
        truncate=reader.flag("truncate", True),
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(reader: _Table, base: RopeConfig) -> RopeConfig:
    short, long = reader.factors("short_factor"), reader.factors("long_factor")
    original = reader.original_length()
    # Phi-3 leaves factor out: the ratio of the context lengths is the factor.
    factor = reader.number("factor") or reader.max_length() / original
    attention = reader.number("attention_factor")
    if attention is None and factor > 1 and original == 1:
        raise reader.error("original_max_position_embeddings", "longrope needs a length above 1")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return replace(
        base,
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention,
        short_factor=short,
        long_factor=long,
    )


_BUILDERS: dict[str, Callable[[_Table, RopeConfig], RopeConfig]] = {
    "default": lambda reader, base: base,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}


def _inv_freq(rope: RopeConfig, dim: int, num_positions: int) -> torch.Tensor:
    """The inverse frequencies: [dim / 2], or [num_positions, dim / 2] for the types that
    depend on the sequence length (row ``p``: for a forward whose largest position is ``p``)."""
    if rope.rope_type == "dynamic":
        return _dynamic_inv_freq(rope, dim, num_positions)
    if rope.rope_type == "longrope":
        short, long = _longrope_inv_freq(rope, dim)
        past_original = torch.arange(num_positions) >= rope.original_max_position_embeddings
        return torch.where(past_original[:, None], long, short)
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    return inv_freq


def _longrope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Longrope's inverse frequencies with its short factors, and with its long ones."""
    short, long = (
        1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** _exponents(dim))
        for factors in (rope.short_factor, rope.long_factor)
    )
    return short, long


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _dynamic_inv_freq(rope: RopeConfig, dim: int, num_positions: int) -> torch.Tensor:
    original, factor, exponent = rope.original_max_position_embeddings, rope.factor, dim / (dim - 2)
    # 1) Up to the original length: transformers' start-up base, in Python floats.
    start = rope.theta * ((factor * original / original) - (factor - 1)) ** exponent
    rows = (1.0 / (start ** _exponents(dim))).expand(min(original, num_positions), -1)
    # 2) Past it: seq_len is a tensor there, so transformers computes the base in float32,
    # one position at a time; its scalar pow is the correctly rounded one, which a float64
    # pow gives (torch's vectorized float32 pow is not).
    seq_len = torch.arange(original + 1, num_positions + 1)
    growth = ((factor * seq_len / original) - (factor - 1)).double() ** exponent
    grown = rope.theta * growth.float()
    return torch.cat((rows, 1.0 / (grown[:, None] ** _exponents(dim))))


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
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


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    pos_freqs = rope.theta ** _exponents(dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
    # NOTE: 1 - (1 - ramp) is not always ramp in float32; transformers computes it this way.
    extrapolation_share = 1 - torch.clamp(ramp, 0, 1)
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (dim * math.log(wavelengths)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
