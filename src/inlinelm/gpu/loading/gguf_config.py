"""The config.json of a GGUF file: its metadata as transformers' config fields, per family.

Every key is gguf's own (``gguf.Keys``); these fields are the whole config
(``gguf_convert.write_config``), every field a family needs. transformers' own GGUF config
reading (``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``) is not used: checked
against transformers 5.24, it gets every family but plain Llama and Qwen2 wrong: a llama file with
experts comes back as a Llama without them, Qwen3's head_dim as 128 whatever the file
says, Qwen3-MoE's expert width as 768, Gemma 2's soft caps and both Gemmas' query scale as
the class defaults, Gemma 3's RoPE scaling and all of Phi-3's long RoPE are lost, and
float32 values such as ``1e-05`` come back as ``9.999999747378752e-06``.

What a GGUF file does not hold, llama.cpp decides, and so do we, the way it does (each
function below says where): Gemma's query scale, Gemma 3's layer pattern and local RoPE base,
Qwen3-MoE's routing, Granite's multipliers when absent. What neither can recover is an
error: llama3-style RoPE (the file keeps only the per-frequency factors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import gguf

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.gguf_metadata import GgufMetadata
from inlinelm.gpu.loading.gguf_names import Family

K = gguf.Keys
T = gguf.MODEL_TENSOR
Tensors = Mapping[str, Any]  # GGUF name -> gguf-py's ReaderTensor
_DEFAULT_ROPE_BASE = 10000.0  # llama.cpp's when a file has no rope.freq_base
_GEMMA3_FULL_EVERY = 6  # llama.cpp: set_swa_pattern(6)
_LARGEST_GEMMA_LAYERS = {"gemma2": 46, "gemma3_text": 62}  # the 27B models


def config_fields(meta: GgufMetadata, family: Family, tensors: Tensors) -> dict[str, Any]:
    """The config.json fields of the file (``tensors``: its tensors by name, for the
    ones that are config: tied embeddings, Phi-3's RoPE factors). ``ModelLoadError``
    names the key or tensor at fault."""
    fields = _common(meta, family, tensors)
    fields |= _FAMILY_FIELDS.get(family.model_type, _nothing)(meta, fields, tensors)
    return fields


def head_dim(meta: GgufMetadata) -> int:
    """The size of one head: ``attention.key_length``, else hidden size / heads."""
    heads = meta.positive_int(K.Attention.HEAD_COUNT)
    hidden = meta.positive_int(K.LLM.EMBEDDING_LENGTH)
    if meta.has(K.Attention.KEY_LENGTH):
        size = meta.positive_int(K.Attention.KEY_LENGTH)
        values = meta.positive_int(K.Attention.VALUE_LENGTH, size)
        if values != size:
            raise meta.error(
                K.Attention.VALUE_LENGTH,
                f"value_length {values} differs from key_length {size}: transformers' "
                "families have one head size",
            )
        return size
    if hidden % heads:
        raise meta.error(
            K.Attention.HEAD_COUNT, f"head_count {heads} does not divide embedding_length {hidden}"
        )
    return hidden // heads


def _common(meta: GgufMetadata, family: Family, tensors: Tensors) -> dict[str, Any]:
    heads = meta.positive_int(K.Attention.HEAD_COUNT)
    size = head_dim(meta)
    kv_heads = meta.positive_int(K.Attention.HEAD_COUNT_KV, heads)
    if heads % kv_heads:
        raise meta.error(
            K.Attention.HEAD_COUNT_KV,
            f"head_count_kv {kv_heads} does not divide head_count {heads}",
        )
    if family.model_type != "phi3" and meta.positive_int(K.Rope.DIMENSION_COUNT, size) != size:
        raise meta.error(
            K.Rope.DIMENSION_COUNT,
            f"a rotary width other than the head size {size}: not part of {family.model_type}",
        )
    return {
        "model_type": family.model_type,
        "vocab_size": meta.positive_int(K.LLM.VOCAB_SIZE, meta.length(K.Tokenizer.LIST)),
        "hidden_size": meta.positive_int(K.LLM.EMBEDDING_LENGTH),
        "intermediate_size": meta.positive_int(K.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.positive_int(K.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": size,
        "max_position_embeddings": meta.positive_int(K.LLM.CONTEXT_LENGTH),
        "rms_norm_eps": meta.positive_float(K.Attention.LAYERNORM_RMS_EPS),
        "rope_parameters": _rope(meta),
        # llama.cpp writes an output tensor only when it is not the embedding
        "tie_word_embeddings": _tensor_name(T.OUTPUT) not in tensors,
        "bos_token_id": _token_id(meta, K.Tokenizer.BOS_ID),
        "eos_token_id": _token_id(meta, K.Tokenizer.EOS_ID),
        "pad_token_id": _token_id(meta, K.Tokenizer.PAD_ID),
    }


def _rope(meta: GgufMetadata) -> dict[str, Any]:
    """``rope_parameters`` from ``rope.freq_base`` and ``rope.scaling.*``."""
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": meta.positive_float(K.Rope.FREQ_BASE, _DEFAULT_ROPE_BASE),
    }
    scaling = meta.string(K.Rope.SCALING_TYPE, gguf.RopeScalingType.NONE.value)
    if scaling == gguf.RopeScalingType.LINEAR.value:
        rope |= {"rope_type": "linear", "factor": meta.positive_float(K.Rope.SCALING_FACTOR)}
    elif scaling == gguf.RopeScalingType.YARN.value:
        rope |= {
            "rope_type": "yarn",
            "factor": meta.positive_float(K.Rope.SCALING_FACTOR),
            "original_max_position_embeddings": meta.positive_int(K.Rope.SCALING_ORIG_CTX_LEN),
        }
        optional = {
            "beta_fast": K.Rope.SCALING_YARN_BETA_FAST,
            "beta_slow": K.Rope.SCALING_YARN_BETA_SLOW,
            "attention_factor": K.Rope.SCALING_YARN_ATTN_FACTOR,
        }
        rope |= {name: meta.positive_float(key) for name, key in optional.items() if meta.has(key)}
    elif scaling != gguf.RopeScalingType.NONE.value:
        raise meta.error(K.Rope.SCALING_TYPE, f"unsupported RoPE scaling type {scaling!r}")
    return rope


def _token_id(meta: GgufMetadata, key: str) -> int | None:
    return meta.count(key) if meta.has(key) else None


def _nothing(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    return {}


def _llama(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    if (name := _tensor_name(T.ROPE_FREQS)) in tensors:
        raise ModelLoadError(
            "llama3-style RoPE: a GGUF file keeps its per-frequency factors but not the "
            "scaling parameters transformers' config is made of (factor, low and high "
            "frequency factors, original context), so it cannot be converted",
            path=str(meta.path),
            field=name,
        )
    return {}


def _mixtral(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """A llama with experts; its experts are ``feed_forward_length`` wide. llama.cpp runs
    the llama architecture without a sliding window, so the config has none."""
    return _llama(meta, fields, tensors) | {
        "num_local_experts": meta.positive_int(K.LLM.EXPERT_COUNT),
        "num_experts_per_tok": meta.positive_int(K.LLM.EXPERT_USED_COUNT),
        "sliding_window": None,
    }


def _qwen3_moe(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Every layer sparse (llama.cpp's qwen3moe has no dense layer); the chosen experts'
    weights renormalised, as llama.cpp runs it, unless ``expert_weights_norm`` says not."""
    return {
        "num_local_experts": meta.positive_int(K.LLM.EXPERT_COUNT),
        "num_experts_per_tok": meta.positive_int(K.LLM.EXPERT_USED_COUNT),
        "moe_intermediate_size": meta.positive_int(K.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "norm_topk_prob": meta.boolean(K.LLM.EXPERT_WEIGHTS_NORM, True),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gemma(meta: GgufMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """What both Gemmas share. The query scale (``query_pre_attn_scalar``) is in no GGUF
    key: llama.cpp takes hidden size / heads for the 27B models (known by their layer
    count) and the head size for the others, and so do we."""
    layers = fields["num_hidden_layers"]
    largest = layers == _LARGEST_GEMMA_LAYERS[fields["model_type"]]
    scalar = (
        fields["hidden_size"] // fields["num_attention_heads"] if largest else fields["head_dim"]
    )
    return {
        "sliding_window": meta.positive_int(K.Attention.SLIDING_WINDOW),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": _optional_float(meta, K.LLM.FINAL_LOGIT_SOFTCAPPING),
    }


def _gemma2(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Soft caps only when the file has them (transformers' defaults, 50 and 30, are not
    what a file without them runs). Every other layer windowed, from the first, as both
    llama.cpp and transformers have it."""
    return _gemma(meta, fields) | {
        "attn_logit_softcapping": _optional_float(meta, K.LLM.ATTN_LOGIT_SOFTCAPPING),
    }


def _gemma3(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Gemma 3's layer pattern is in no GGUF key: llama.cpp makes every sixth layer full
    attention and the rest windowed. Its windowed layers rotate unscaled, at
    ``rope.freq_base_swa`` (llama.cpp: 10000, what every Gemma 3 has); its full ones with the
    file's base and scaling."""
    layers = fields["num_hidden_layers"]
    local = {
        "rope_type": "default",
        "rope_theta": meta.positive_float(K.Rope.FREQ_BASE_SWA, _DEFAULT_ROPE_BASE),
    }
    return _gemma(meta, fields) | {
        "attn_logit_softcapping": None,
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_FULL_EVERY == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_parameters": {
            "full_attention": fields["rope_parameters"],
            "sliding_attention": local,
        },
    }


def _phi3(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Phi-3 rotates the first ``rope.dimension_count`` dimensions of each head; a window of
    0 is none (llama.cpp's mark of a Phi-3 without one). Long RoPE's factors are tensors,
    its attention factor transformers' default unless the file's differs."""
    size = fields["head_dim"]
    rotary = meta.positive_int(K.Rope.DIMENSION_COUNT, size)
    original = meta.positive_int(K.Rope.SCALING_ORIG_CTX_LEN, fields["max_position_embeddings"])
    rope = fields["rope_parameters"] | _long_rope(meta, tensors, rotary, original, fields)
    return {
        "partial_rotary_factor": rotary / size,
        "original_max_position_embeddings": original,
        "sliding_window": meta.count(K.Attention.SLIDING_WINDOW, 0) or None,
        "rope_parameters": rope | {"partial_rotary_factor": rotary / size},
    }


def _long_rope(
    meta: GgufMetadata, tensors: Tensors, rotary: int, original: int, fields: dict[str, Any]
) -> dict[str, Any]:
    long_name, short_name = _tensor_name(T.ROPE_FACTORS_LONG), _tensor_name(T.ROPE_FACTORS_SHORT)
    if long_name not in tensors:
        return {}
    factors = {name: _factors(meta, tensors, name, rotary // 2) for name in (long_name, short_name)}
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": factors[long_name],
        "short_factor": factors[short_name],
        "original_max_position_embeddings": original,
    }
    scale = fields["max_position_embeddings"] / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stated = meta.positive_float(K.Rope.SCALING_ATTN_FACTOR, default)
    if _as_float32(stated) != _as_float32(default):
        rope["attention_factor"] = stated
    return rope


def _factors(meta: GgufMetadata, tensors: Tensors, name: str, count: int) -> list[float]:
    import numpy as np

    if name not in tensors:
        raise ModelLoadError("long RoPE needs both factor tensors", path=str(meta.path), field=name)
    tensor = tensors[name]
    if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        raise ModelLoadError(
            f"RoPE factors stored as {tensor.tensor_type.name}, not F32 or F16",
            path=str(meta.path),
            field=name,
        )
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(-1)
    if values.shape != (count,):
        raise ModelLoadError(
            f"{values.size} factors, but half the rotary dimensions is {count}",
            path=str(meta.path),
            field=name,
        )
    return [_as_float32(float(v)) for v in values]


def _olmo2(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    if meta.has(K.Attention.SLIDING_WINDOW):
        raise meta.error(
            K.Attention.SLIDING_WINDOW,
            "an OLMo 3 file (llama.cpp writes it as olmo2 with a sliding window); inlinelm "
            "runs OLMo 2",
        )
    return {}


def _granite(meta: GgufMetadata, fields: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """A multiplier the file lacks means what llama.cpp makes of it: the usual
    1/sqrt(head size) attention scale, and no scaling of the embeddings, residuals or logits."""
    return _llama(meta, fields, tensors) | {
        "attention_multiplier": meta.positive_float(
            K.Attention.SCALE, 1 / math.sqrt(fields["head_dim"])
        ),
        "embedding_multiplier": meta.positive_float(K.LLM.EMBEDDING_SCALE, 1.0),
        "residual_multiplier": meta.positive_float(K.LLM.RESIDUAL_SCALE, 1.0),
        "logits_scaling": meta.positive_float(K.LLM.LOGIT_SCALE, 1.0),
    }


_FAMILY_FIELDS: dict[str, Callable[[GgufMetadata, dict[str, Any], Tensors], dict[str, Any]]] = {
    "llama": _llama,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "granite": _granite,
}


def _optional_float(meta: GgufMetadata, key: str) -> float | None:
    return meta.positive_float(key) if meta.has(key) else None


def _as_float32(value: float) -> float:
    """The shortest decimal of ``value`` rounded to float32 (how GGUF stores it)."""
    import numpy as np

    return float(str(np.float32(value)))


def _tensor_name(kind: Any) -> str:
    return f"{gguf.TENSOR_NAMES[kind]}.weight"
