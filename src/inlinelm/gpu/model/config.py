"""The architecture of a model, read from its config.json: the fields every family shares.

:func:`base_config` reads what a Llama-shaped config says (sizes, heads, RoPE, the
layers' attention kinds); each family's file (``inlinelm.gpu.model.models``) then sets
what its own config adds, and :func:`inlinelm.gpu.model.registry.parse_config` runs both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from inlinelm.gpu.attention.metadata import LayerAttention
from inlinelm.gpu.model.fields import ConfigFields, show
from inlinelm.gpu.model.rope import RopeConfig, parse_rope

MAX_LAYERS = 4096
"""The most layers a config may give (the largest models have ~130): a config's layer list
is built before the memory check, so a hostile count must fail first."""

Activation = Literal["silu", "gelu_tanh"]
QKNorm = Literal["none", "head", "whole"]
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: ``top_k`` of ``num_experts`` gated SiLU experts of
    ``intermediate_size`` per token, their weights the router's softmax over the chosen
    ones (``renormalize``) or over all experts (not)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one decoder layer does that others may not: its attention kind, which RoPE
    table it rotates with (``"global"``, ``"local"``, or None for none) and whether its
    MLP is the sparse one."""

    attention: LayerAttention
    rope: Literal["global", "local"] | None = "global"
    sparse: bool = False


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields our model code needs; the defaults are Llama's."""

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
    layers: tuple[LayerSpec, ...]
    sliding_window: int | None = None
    attention_out_bias: bool = False
    mlp_bias: bool = False
    rotary_dim: int = 0  # 0: the whole head
    activation: Activation = "silu"
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + weight)
    qk_norm: QKNorm = "none"
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    final_softcap: float | None = None
    local_rope: RopeConfig | None = None
    moe: MoEConfig | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, in float32 (scale for other dtypes)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    @property
    def rotated_dim(self) -> int:
        """The dimensions of each head RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def attention_kinds(self) -> tuple[LayerAttention, ...]:
        """The distinct attention kinds of the layers, in layer order (one plan each)."""
        return tuple(dict.fromkeys(spec.attention for spec in self.layers))


def base_config(fields: ConfigFields, model_type: str, *, model_wide_window: bool) -> ModelConfig:
    """The Llama-shaped fields of a config.json, checked (``ModelLoadError`` names the
    field at fault). ``model_wide_window``: a ``sliding_window`` without ``layer_types``
    windows every layer (Mistral, Mixtral, Phi-3); otherwise only ``layer_types`` (or
    Qwen's ``use_sliding_window``) makes a layer sliding."""
    hidden = fields.positive_int("hidden_size")
    heads = fields.positive_int("num_attention_heads")
    num_layers = fields.positive_int("num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise fields.error(
            "num_hidden_layers", f"num_hidden_layers {num_layers} is past {MAX_LAYERS}"
        )
    head_dim = _head_dim(fields, hidden, heads)
    window = _window(fields)
    attention_bias = fields.boolean("attention_bias", False)
    types = layer_types(fields, num_layers, window, model_wide_window=model_wide_window)
    return ModelConfig(
        model_type=model_type,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_num_kv_heads(fields, heads),
        head_dim=head_dim,
        rms_norm_eps=fields.positive_number("rms_norm_eps", 1e-6),
        max_position_embeddings=fields.positive_int("max_position_embeddings", 2048),
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
        attention_bias=attention_bias,
        attention_out_bias=attention_bias,
        mlp_bias=fields.boolean("mlp_bias", False),
        rope=_rope(fields),
        eos_token_ids=_eos(fields),
        sliding_window=window if "sliding_attention" in types else None,
        layers=tuple(
            LayerSpec(
                LayerAttention(
                    scale=head_dim**-0.5,
                    sliding_window=window if kind == "sliding_attention" else None,
                )
            )
            for kind in types
        ),
    )


def given_layer_types(fields: ConfigFields, num_layers: int) -> tuple[str, ...] | None:
    """The config's ``layer_types`` checked (one of :data:`LAYER_TYPES` per layer), or
    None when it gives none."""
    given = fields.raw.get("layer_types")
    if given is None:
        return None
    if (
        not isinstance(given, list)
        or len(given) != num_layers
        or any(kind not in LAYER_TYPES for kind in given)
    ):
        raise fields.error(
            "layer_types",
            f"invalid layer_types: {show(given)} (one of {', '.join(LAYER_TYPES)} "
            f"per layer, {num_layers} layers)",
        )
    return tuple(given)


def layer_types(
    fields: ConfigFields, num_layers: int, window: int | None, *, model_wide_window: bool
) -> tuple[str, ...]:
    """Each layer's ``full_attention`` or ``sliding_attention``: the config's
    ``layer_types`` when given, else as ``base_config`` says."""
    given = given_layer_types(fields, num_layers)
    if given is not None:
        if "sliding_attention" in given and window is None:
            raise fields.error("sliding_window", "sliding layers need a sliding_window")
        return tuple(given)
    if window is None:
        return ("full_attention",) * num_layers
    if model_wide_window:
        return ("sliding_attention",) * num_layers
    if not fields.boolean("use_sliding_window", False):
        return ("full_attention",) * num_layers
    first = fields.non_negative_int("max_window_layers", num_layers)
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))


def _rope(fields: ConfigFields) -> RopeConfig:
    """The RoPE of the model (of its full-attention layers where transformers 5 writes
    settings per layer type: Gemma 3 reads its sliding layers' own)."""
    params = fields.table("rope_parameters")
    if "full_attention" in params:
        full = params["full_attention"]
        if not isinstance(full, dict):
            raise fields.error(
                "rope_parameters.full_attention", "invalid RoPE settings (an object)"
            )
        return parse_rope(fields, table=full, source="rope_parameters.full_attention")
    return parse_rope(fields)


def _window(fields: ConfigFields) -> int | None:
    window = fields.raw.get("sliding_window")
    if window is None:
        return None
    return fields.positive_int("sliding_window")


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
