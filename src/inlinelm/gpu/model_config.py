"""The architecture of a Llama-family model, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_SUPPORTED_ROPE = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings; ``rope_type`` is ``default`` or ``llama3``."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields our Llama-family model code needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, in float32 (scale for other dtypes)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """Read ``folder/config.json``; raise ``ModelLoadError`` naming the field at fault."""
        path = folder / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read config ({e})", path=str(path)) from e
        return _parse(raw, str(path))


def _parse(raw: dict[str, Any], path: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
            path=path,
            field="model_type",
        )
    hidden = _int(raw, "hidden_size", path)
    heads = _int(raw, "num_attention_heads", path)
    head_dim = raw.get("head_dim") or hidden // heads
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int(raw, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", path),
        num_layers=_int(raw, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        rope=_rope(raw, path),
        eos_token_ids=_eos(raw.get("eos_token_id")),
        sliding_window=_sliding_window(raw),
    )


def _int(raw: dict[str, Any], name: str, path: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"missing or invalid {name}: {value!r}", path=path, field=name)
    return value


def _rope(raw: dict[str, Any], path: str) -> RopeConfig:
    # transformers 5 writes rope_parameters; older configs write rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE:
        raise ModelLoadError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE)}",
            path=path,
            field="rope_scaling",
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )


def _eos(value: object) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return ()


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return int(window) if isinstance(window, int) and window > 0 else None
