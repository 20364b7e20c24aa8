"""The architecture of a Llama-family model, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.model.fields import ConfigFields, show
from inlinelm.gpu.model.rope import RopeConfig, parse_rope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""The ``architectures`` entries of a config we run (a checkpoint of another head, such as
a classifier or an encoder, holds other tensors)."""


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
        """Read and check ``folder/config.json``.

        Raises ``ModelLoadError`` naming the file and the field at fault: an unreadable file,
        a value of the wrong type or out of range, head counts that do not divide, an
        architecture we do not run. Sizes are not judged here (see ``model_memory``).
        """
        path = folder / "config.json"
        try:
            raw = json.loads(path.read_text())
        # NOTE: ValueError covers bad JSON, bad UTF-8 and integers past Python's digit limit.
        except (OSError, ValueError, RecursionError) as e:
            raise ModelLoadError(f"cannot read config ({e})", path=str(path)) from e
        if not isinstance(raw, dict):
            raise ModelLoadError(
                f"config is a JSON {type(raw).__name__}, not an object", path=str(path)
            )
        return parse_config(raw, str(path))


def parse_config(raw: dict[str, Any], path: str) -> ModelConfig:
    """Check a parsed config.json (``path`` names it in errors) and build the ModelConfig."""
    fields = ConfigFields(raw, path)
    model_type = _model_type(fields)
    hidden = fields.positive_int("hidden_size")
    heads = fields.positive_int("num_attention_heads")
    return ModelConfig(
        model_type=model_type,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_layers=fields.positive_int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_num_kv_heads(fields, heads),
        head_dim=_head_dim(fields, hidden, heads),
        rms_norm_eps=fields.positive_number("rms_norm_eps", 1e-6),
        max_position_embeddings=fields.positive_int("max_position_embeddings", 2048),
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or fields.boolean("attention_bias", False),
        rope=parse_rope(fields),
        eos_token_ids=_eos(fields),
        sliding_window=_sliding_window(fields, model_type),
    )


def _model_type(fields: ConfigFields) -> str:
    model_type = fields.raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise fields.error(
            "model_type",
            f"unsupported architecture {show(model_type)}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    architectures = fields.raw.get("architectures")
    if architectures is None:
        return str(model_type)
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise fields.error("architectures", f"invalid architectures: {show(architectures)}")
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise fields.error(
            "architectures",
            f"unsupported architectures {show(architectures)}; inlinelm runs causal LMs: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return str(model_type)


def _num_kv_heads(fields: ConfigFields, heads: int) -> int:
    num_kv_heads = fields.positive_int("num_key_value_heads", heads)
    if heads % num_kv_heads:
        raise fields.error(
            "num_key_value_heads",
            f"num_key_value_heads {num_kv_heads} does not divide num_attention_heads {heads}",
        )
    return num_kv_heads


def _head_dim(fields: ConfigFields, hidden: int, heads: int) -> int:
    """``head_dim`` when given, else hidden_size / num_attention_heads; even (RoPE rotates
    pairs of dimensions)."""
    if fields.raw.get("head_dim") is not None:
        name, head_dim = "head_dim", fields.positive_int("head_dim")
    elif hidden % heads:
        raise fields.error(
            "num_attention_heads",
            f"num_attention_heads {heads} does not divide hidden_size {hidden} "
            "(and no head_dim is given)",
        )
    else:
        name, head_dim = "num_attention_heads", hidden // heads
    if head_dim % 2:
        raise fields.error(name, f"the head dimension {head_dim} is odd; RoPE needs it even")
    return head_dim


def _eos(fields: ConfigFields) -> tuple[int, ...]:
    value = fields.raw.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise fields.error("eos_token_id", f"invalid eos_token_id: {show(value)} (token ids)")
    return tuple(ids)


def _sliding_window(fields: ConfigFields, model_type: str) -> int | None:
    window = fields.raw.get("sliding_window")
    if model_type == "qwen2" and not fields.boolean("use_sliding_window", False):
        return None
    return (
        window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    )
