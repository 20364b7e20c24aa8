"""The architecture of an encoder model (BERT, XLM-RoBERTa, ModernBERT), read from its
config.json.

One frozen :class:`EncoderConfig` holds the fields every family shares and, with
defaults, those only one family reads; :func:`read_encoder_config` checks each field
(``ModelLoadError`` names the file and the field) and fills in the family's own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from inlinelm.gpu.model.config import given_layer_types
from inlinelm.gpu.model.fields import ConfigFields, read_config_json, show

ENCODER_MODEL_TYPES: tuple[str, ...] = ("bert", "roberta", "xlm-roberta", "modernbert")
"""The config.json ``model_type`` values :func:`read_encoder_config` reads."""

MAX_LAYERS = 1024
"""The most layers a config may give (the largest encoders have 48)."""

Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
Pooling = Literal["cls", "mean"]

_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",  # transformers' exact (erf) GELU
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_DEFAULT_PAD = {"bert": 0, "roberta": 1, "xlm-roberta": 1, "modernbert": 50283}


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The fields our encoder models need.

    ``num_labels`` is 0 unless ``classifier`` (the checkpoint is a
    ``*ForSequenceClassification``). BERT and XLM-RoBERTa read ``type_vocab_size`` and
    ``position_offset`` (the position id of a sequence's first token: 0 for BERT,
    ``pad_token_id + 1`` for XLM-RoBERTa); ModernBERT reads the rest: ``layer_windows``
    holds each layer's half window (a token attends to those at most that far away) or
    None for a global layer.
    """

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    pad_token_id: int
    num_labels: int
    classifier: bool
    activation: Activation = "gelu"
    type_vocab_size: int = 2
    position_offset: int = 0
    layer_windows: tuple[int | None, ...] = ()
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    classifier_pooling: Pooling = "cls"
    classifier_bias: bool = False
    classifier_activation: Activation = "gelu"

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def max_model_len(self) -> int:
        """The longest input (in tokens, special ones included) the model takes."""
        return self.max_position_embeddings - self.position_offset


def is_encoder_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json is one of an encoder family we run."""
    return raw.get("model_type") in ENCODER_MODEL_TYPES


def read_encoder_config(folder: Path) -> EncoderConfig:
    """Read and check ``folder/config.json``.

    Raises ``ModelLoadError`` naming the file and the field at fault: an unreadable file,
    a ``model_type`` not in :data:`ENCODER_MODEL_TYPES`, a value of the wrong type or out
    of range, heads that do not divide the hidden size, a setting we do not run (relative
    position embeddings, a decoder BERT, a RoPE scaling).
    """
    return parse_encoder_config(read_config_json(folder), str(folder / "config.json"))


def parse_encoder_config(raw: dict[str, Any], path: str) -> EncoderConfig:
    """:func:`read_encoder_config` on a parsed config (``path`` names it in errors)."""
    fields = ConfigFields(raw, path)
    model_type = raw.get("model_type")
    if not is_encoder_config(raw):
        raise fields.error(
            "model_type",
            f"model_type {show(model_type)} is not an encoder we run "
            f"({', '.join(ENCODER_MODEL_TYPES)})",
        )
    assert isinstance(model_type, str)
    if model_type == "modernbert":
        return _modernbert(fields)
    return _bert(fields, model_type)


def _bert(fields: ConfigFields, model_type: str) -> EncoderConfig:
    """BERT and XLM-RoBERTa: learned absolute positions, token types, post-norm layers."""
    kind = fields.raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise fields.error(
            "position_embedding_type",
            f"position_embedding_type {show(kind)} is not supported (only absolute)",
        )
    if fields.boolean("is_decoder", False):
        raise fields.error("is_decoder", "a decoder BERT is not an encoder")
    pad = fields.non_negative_int("pad_token_id", _DEFAULT_PAD[model_type])
    offset = pad + 1 if model_type in ("roberta", "xlm-roberta") else 0
    cfg = replace(
        _shared(fields, model_type, pad, eps_name="layer_norm_eps", eps=1e-12),
        activation=_activation(fields, "hidden_act"),
        type_vocab_size=fields.positive_int("type_vocab_size", 2),
        position_offset=offset,
    )
    if cfg.max_model_len <= 0:
        raise fields.error(
            "max_position_embeddings",
            f"max_position_embeddings {cfg.max_position_embeddings} leaves no position "
            f"after the offset {offset} (pad_token_id + 1)",
        )
    return cfg


def _modernbert(fields: ConfigFields) -> EncoderConfig:
    """ModernBERT: RoPE, alternating global and sliding-window layers, GeGLU, pre-norm."""
    pad = fields.non_negative_int("pad_token_id", _DEFAULT_PAD["modernbert"])
    shared = _shared(fields, "modernbert", pad, eps_name="norm_eps", eps=1e-5)
    pooling = fields.raw.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise fields.error(
            "classifier_pooling", f"invalid classifier_pooling: {show(pooling)} (cls or mean)"
        )
    global_theta, local_theta = _rope_thetas(fields)
    return replace(
        shared,
        activation=_activation(fields, "hidden_activation"),
        layer_windows=_layer_windows(fields, shared.num_layers),
        global_rope_theta=global_theta,
        local_rope_theta=local_theta,
        attention_bias=fields.boolean("attention_bias", False),
        mlp_bias=fields.boolean("mlp_bias", False),
        norm_bias=fields.boolean("norm_bias", False),
        classifier_pooling=pooling,
        classifier_bias=fields.boolean("classifier_bias", False),
        classifier_activation=_activation(fields, "classifier_activation"),
    )


def _shared(
    fields: ConfigFields, model_type: str, pad: int, *, eps_name: str, eps: float
) -> EncoderConfig:
    """The fields every family has (the others at their defaults)."""
    hidden = fields.positive_int("hidden_size")
    heads = fields.positive_int("num_attention_heads")
    if hidden % heads:
        raise fields.error(
            "num_attention_heads",
            f"num_attention_heads {heads} does not divide hidden_size {hidden}",
        )
    num_layers = fields.positive_int("num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise fields.error(
            "num_hidden_layers", f"num_hidden_layers {num_layers} is past {MAX_LAYERS}"
        )
    classifier = _is_classifier(fields)
    default_max = 8192 if model_type == "modernbert" else 512
    return EncoderConfig(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        intermediate_size=fields.positive_int("intermediate_size"),
        vocab_size=fields.positive_int("vocab_size"),
        max_position_embeddings=fields.positive_int("max_position_embeddings", default_max),
        layer_norm_eps=fields.positive_number(eps_name, eps),
        pad_token_id=pad,
        num_labels=_num_labels(fields) if classifier else 0,
        classifier=classifier,
    )


def _is_classifier(fields: ConfigFields) -> bool:
    architectures = fields.raw.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise fields.error(
            "architectures", f"invalid architectures: {show(architectures)} (a list of names)"
        )
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def _num_labels(fields: ConfigFields) -> int:
    """``len(id2label)``, as transformers counts labels (2 when the config names none)."""
    labels = fields.raw.get("id2label")
    if labels is None:
        return fields.positive_int("num_labels", 2)
    if not isinstance(labels, dict) or not labels:
        raise fields.error("id2label", f"invalid id2label: {show(labels)} (a non-empty object)")
    return len(labels)


def _activation(fields: ConfigFields, name: str) -> Activation:
    value = fields.raw.get(name, "gelu")
    if value not in _ACTIVATIONS:
        raise fields.error(
            name, f"activation {show(value)} is not supported ({', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[value]


def _layer_windows(fields: ConfigFields, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's half window, None for global ones: ``layer_types`` (transformers 5)
    when given, else every ``global_attn_every_n_layers``-th layer (from the first) is
    global. A local layer's token sees those within ``local_attention // 2``."""
    half = fields.positive_int("local_attention", 128) // 2
    given = given_layer_types(fields, num_layers)
    if given is None:
        every = fields.positive_int("global_attn_every_n_layers", 3)
        return tuple(None if i % every == 0 else half for i in range(num_layers))
    return tuple(half if kind == "sliding_attention" else None for kind in given)


def _rope_thetas(fields: ConfigFields) -> tuple[float, float]:
    """The global and local layers' RoPE bases: ``rope_parameters`` per layer type
    (transformers 5), else ``global_rope_theta`` / ``local_rope_theta``."""
    params = fields.table("rope_parameters")
    thetas = []
    for kind, old_name, default in (
        ("full_attention", "global_rope_theta", 160_000.0),
        ("sliding_attention", "local_rope_theta", 10_000.0),
    ):
        table = params.get(kind) or {}
        source = f"rope_parameters.{kind}"
        if not isinstance(table, dict):
            raise fields.error(source, f"invalid {source}: {show(table)} (an object)")
        rope_type = table.get("rope_type", "default")
        if rope_type != "default":
            raise fields.error(
                f"{source}.rope_type", f"RoPE type {show(rope_type)} is not supported"
            )
        fallback = fields.positive_number(old_name, default)
        thetas.append(fields.positive_number("rope_theta", fallback, table))
    return thetas[0], thetas[1]
