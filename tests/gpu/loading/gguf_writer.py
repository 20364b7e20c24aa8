"""Write a Hugging Face folder as the GGUF file llama.cpp's ``convert_hf_to_gguf.py`` makes
of it, for the GGUF family tests.

What llama.cpp does, per family (its converter, read for this; our own code): the
architecture's tensor names (gguf's ``TensorNameMap``) and metadata keys (``GGUFWriter``'s
``add_*``); the Q/K rows of the llama-architecture families (Llama, Mixtral, Granite)
permuted into its interleaved rotary layout; Gemma's norms stored as ``1 + w``; each
layer's experts stacked into one ``[experts, out, in]`` tensor; Phi-3's long-RoPE factors
as tensors; the tokenizer's vocabulary, merges, special ids and chat template
(``gguf.SpecialVocab``). Tensors are float32, or Q8_0 under llama.cpp's rule: 1-D tensors,
norms and routers stay float32, and a tensor whose rows do not split into 32-value blocks
falls back to float16.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gpu.reference import folder_tensors

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
GGUF_ARCHS = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "granite": "granite",
}
"""The ``general.architecture`` llama.cpp writes for each ``model_type`` (Mixtral is a
llama with experts)."""
PERMUTED = ("llama", "mixtral", "granite")
"""The families llama.cpp's converter ``LlamaModel.permute``s the Q/K rows of."""
GEMMA = ("gemma2", "gemma3_text")
_EXPERT = {  # one expert's projection name -> the name of the stacked tensor
    "mixtral": ("block_sparse_moe.experts.{xid}.{w}", ("w1", "w2", "w3")),
    "qwen3_moe": ("mlp.experts.{xid}.{w}", ("gate_proj", "up_proj", "down_proj")),
}
_ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


RawTensors = Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]


def write_family_gguf(
    folder: Path,
    path: Path,
    qtype: gguf.GGMLQuantizationType = F32,
    *,
    raw: RawTensors | None = None,
) -> dict[str, gguf.GGMLQuantizationType]:
    """Write at ``path`` the GGUF file llama.cpp would write of the model in ``folder``
    (float32 or Q8_0); ``raw`` replaces tensors, by GGUF name, with bytes of the given type.
    Returns the type each tensor was written in, by GGUF name."""
    raw = raw or {}
    types: dict[str, gguf.GGMLQuantizationType] = {}
    config = json.loads((folder / "config.json").read_text())
    model_type = config["model_type"]
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHS[model_type])
    writer.add_name(folder.name)
    _add_parameters(writer, config)
    _add_tokenizer(writer, folder, config["vocab_size"])
    tensors = {k: v.float() for k, v in folder_tensors(folder).items()}
    tensor_map = gguf.get_tensor_name_map(_ARCHS[writer.arch], config["num_hidden_layers"])
    for name, data in _gguf_tensors(model_type, config, tensors):
        gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{name} has no {writer.arch} tensor"
        if gguf_name in raw:
            writer.add_tensor(gguf_name, raw[gguf_name][0], raw_dtype=raw[gguf_name][1])
            types[gguf_name] = raw[gguf_name][1]
        else:
            types[gguf_name] = _add_tensor(writer, gguf_name, data.numpy(), qtype)
    for name, factors in _rope_factor_tensors(config):
        types[name] = _add_tensor(writer, name, factors, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def _add_parameters(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    """The ``{arch}.*`` keys: ``TextModel.set_gguf_parameters`` and each family's own."""
    model_type = c["model_type"]
    if model_type in ("gemma2", "phi3"):
        # NOTE: llama.cpp's Gemma2 and Phi-3 converters write their own set, not the base's.
        _add_sizes(w, c)
    else:
        _add_text_model(w, c)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if model_type in ("llama", "mixtral", "granite"):
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if model_type == "granite":
        w.add_attention_scale(c["attention_multiplier"])
        w.add_embedding_scale(c["embedding_multiplier"])
        w.add_residual_scale(c["residual_multiplier"])
        w.add_logit_scale(c["logits_scaling"])
    elif model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    elif model_type == "gemma2":
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    elif model_type == "gemma3_text":
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    elif model_type == "phi3":
        _add_phi3(w, c, head_dim)


def _add_sizes(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _add_text_model(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    _add_sizes(w, c)
    rope = c.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if (beta_fast := full.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := full.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(beta_slow)
        if (attention_factor := full.get("attention_factor")) is not None:
            w.add_rope_scaling_yarn_attn_factor(attention_factor)
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if (experts := c.get("num_local_experts") or c.get("num_experts")) is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    # NOTE: llama.cpp's Granite converter drops head_dim before the base writes it.
    if c.get("head_dim") is not None and c["model_type"] != "granite":
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])


def _add_phi3(w: gguf.GGUFWriter, c: dict[str, Any], head_dim: int) -> None:
    rope = c["rope_parameters"]
    rope_dims = (
        int(rope.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]
    )
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = c["max_position_embeddings"] / rope["original_max_position_embeddings"]
        orig = rope["original_max_position_embeddings"]
        factor = np.sqrt(1 + np.log(scale) / np.log(orig)) if scale > 1.0 else 1.0
        w.add_rope_scaling_attn_factors(float(factor))


def _rope_factor_tensors(c: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Phi-3's long-RoPE factors, which llama.cpp writes as tensors."""
    rope = c.get("rope_parameters") or {}
    if c["model_type"] != "phi3" or not rope.get("long_factor"):
        return []
    T = gguf.MODEL_TENSOR
    return [
        (gguf.TENSOR_NAMES[T.ROPE_FACTORS_LONG] + ".weight", np.array(rope["long_factor"])),
        (gguf.TENSOR_NAMES[T.ROPE_FACTORS_SHORT] + ".weight", np.array(rope["short_factor"])),
    ]


def _gguf_tensors(
    model_type: str, c: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The folder's tensors as llama.cpp changes them, under the names its tensor map
    knows (each layer's experts stacked)."""
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    out: list[tuple[str, torch.Tensor]] = []
    stacked: set[str] = set()
    for name, data in tensors.items():
        if model_type in PERMUTED and ".q_proj." in name:
            data = _permute(data, heads)
        elif model_type in PERMUTED and ".k_proj." in name:
            data = _permute(data, kv_heads)
        if model_type in GEMMA and name.endswith("norm.weight"):
            data = data + 1
        if model_type in _EXPERT and ".experts." in name:
            merged = _stack_experts(model_type, name, c, tensors)
            if merged[0] not in stacked:
                stacked.add(merged[0])
                out.append(merged)
            continue
        out.append((name, data))
    return out


def _stack_experts(
    model_type: str, name: str, c: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> tuple[str, torch.Tensor]:
    template, projections = _EXPERT[model_type]
    prefix, _, rest = name.partition(".experts.")
    w = next(p for p in projections if rest.endswith(f".{p}.weight"))
    num_experts = c.get("num_local_experts") or c["num_experts"]
    parent = prefix.rsplit(".", 1)[0]  # model.layers.N
    names = [f"{parent}.{template.format(xid=x, w=w)}.weight" for x in range(num_experts)]
    return f"{prefix}.experts.{w}.weight", torch.stack([tensors[n] for n in names])


def _permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved."""
    w = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _add_tensor(
    w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> gguf.GGMLQuantizationType:
    """Add the tensor under llama.cpp's type rule (norms, 1-D tensors and routers float32,
    the rest ``qtype``); returns the type it is stored in."""
    data = data.astype(np.float32)
    router = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].split(".")[-1]
    if data.ndim <= 1 or name.endswith("_norm.weight") or f".{router}." in name:
        qtype = F32
    try:
        raw = gguf.quants.quantize(data, qtype)
    except gguf.QuantError:
        qtype = gguf.GGMLQuantizationType.F16
        raw = gguf.quants.quantize(data, qtype)
    w.add_tensor(name, raw, raw_dtype=qtype)
    return qtype


def _add_tokenizer(w: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The byte-level BPE vocabulary of ``folder/tokenizer.json`` as llama.cpp's
    ``_set_vocab_gpt2`` writes it, with its merges and special ids."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, gguf.TokenType.NORMAL)
    for added in tokenizer["added_tokens"]:
        by_id[added["id"]] = added["content"]
        types[added["id"]] = (
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([types.get(i, gguf.TokenType.USER_DEFINED) for i in range(vocab_size)])
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(w)


BLOCK_SCALE = {gguf.GGMLQuantizationType.Q8_0: 1 / 2048, gguf.GGMLQuantizationType.Q4_0: 1 / 256}
"""The float16 scale ``d`` (the first two bytes of each block) of :func:`write_random_gguf`'s
blocks: weights of size ~0.06 and ~0.03, as a trained model's are."""


def write_random_gguf(
    path: Path, config: dict[str, Any], qtype: gguf.GGMLQuantizationType, tokenizer_dir: Path
) -> int:
    """Write at ``path`` a Llama- or Qwen2-architecture GGUF file of the model ``config``
    (a transformers config's fields) with random weights: every matrix of ``qtype``
    (``Q8_0`` or ``Q4_0``) as random blocks of one scale, norms float32 ones, biases
    float32 zeros; the tokenizer of ``tokenizer_dir`` padded to the vocabulary. Tensors are
    made and written one at a time, so a 7B-shaped file takes a tensor's memory. Returns
    the file's size."""
    model_type = config["model_type"]
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHS[model_type])
    writer.add_name(path.stem)
    _add_parameters(writer, config)
    _add_tokenizer(writer, tokenizer_dir, config["vocab_size"])
    tensors = list(_random_tensors(config))
    tensor_map = gguf.get_tensor_name_map(_ARCHS[writer.arch], config["num_hidden_layers"])
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    for name, shape in tensors:
        gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{name} has no {writer.arch} tensor"
        if len(shape) == 2:
            nbytes = shape[0] * shape[1] // block * size
            byte_shape = (shape[0], shape[1] // block * size)
            writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), nbytes, qtype)
        else:
            writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), 4 * shape[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(BLOCK_SCALE[qtype]).tobytes(), dtype=np.uint8)
    for name, shape in tensors:
        if len(shape) == 2:
            data = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
            data[:, :, :2] = scale
            writer.write_tensor_data(data.reshape(shape[0], -1))
        else:
            fill = 0.0 if name.endswith(".bias") else 1.0
            writer.write_tensor_data(np.full(shape, fill, dtype=np.float32))
    writer.close()
    return path.stat().st_size


def _random_tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The transformers tensor names and shapes of a Llama/Qwen2 model of ``config``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    names: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden))
    ]
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        names += [
            (f"{layer}.input_layernorm.weight", (hidden,)),
            (f"{layer}.self_attn.q_proj.weight", (q, hidden)),
            (f"{layer}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{layer}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{layer}.self_attn.o_proj.weight", (hidden, q)),
            (f"{layer}.post_attention_layernorm.weight", (hidden,)),
            (f"{layer}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{layer}.mlp.up_proj.weight", (inter, hidden)),
            (f"{layer}.mlp.down_proj.weight", (hidden, inter)),
        ]
        if config["model_type"] == "qwen2":
            names += [
                (f"{layer}.self_attn.{p}.bias", (n,))
                for p, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
            ]
    names.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings"):
        names.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return names
