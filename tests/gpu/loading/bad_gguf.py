"""The GGUF cases of the bad-model corpus, and the tiny GGUF file they break: two llama
layers with a 261-token byte-level vocabulary, so a good one converts in about a second."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.gpu.loading.bad_models import BadModel, Builder, Sources, registry

GgufValue = tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]
CASES: dict[str, Builder] = {}
bad_model = registry(CASES)

U32, F32, STR, ARR = (
    gguf.GGUFValueType.UINT32,
    gguf.GGUFValueType.FLOAT32,
    gguf.GGUFValueType.STRING,
    gguf.GGUFValueType.ARRAY,
)
TINY_GGUF_SHAPE = {"hidden": 64, "inter": 256, "layers": 2, "heads": 4, "kv_heads": 2}
"""The tiny GGUF's architecture: intermediate 256 so a K-quant tensor (256-wide blocks) fits."""


@dataclass(slots=True)
class GgufParts:
    """Everything a tiny GGUF file holds, for builders to break before it is written."""

    arch: str
    fields: dict[str, GgufValue]
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] = field(
        default_factory=dict
    )


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map: 256 printable characters, one per byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tiny_gguf_parts() -> GgufParts:
    """A 2-layer llama GGUF with a byte-level BPE vocabulary of 261 tokens."""
    s = TINY_GGUF_SHAPE
    hidden, inter, heads, kv_heads = s["hidden"], s["inter"], s["heads"], s["kv_heads"]
    head_dim = hidden // heads
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_alphabet(), "he", "Ġt"]
    fields: dict[str, GgufValue] = {
        "llama.block_count": (s["layers"], U32, None),
        "llama.context_length": (2048, U32, None),
        "llama.embedding_length": (hidden, U32, None),
        "llama.feed_forward_length": (inter, U32, None),
        "llama.attention.head_count": (heads, U32, None),
        "llama.attention.head_count_kv": (kv_heads, U32, None),
        "llama.rope.dimension_count": (head_dim, U32, None),
        "llama.rope.freq_base": (10000.0, F32, None),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, F32, None),
        "tokenizer.ggml.model": ("gpt2", STR, None),
        "tokenizer.ggml.pre": ("smollm", STR, None),
        "tokenizer.ggml.tokens": (tokens, ARR, STR),
        "tokenizer.ggml.token_type": ([3, 3, 3] + [1] * (len(tokens) - 3), ARR, U32),
        "tokenizer.ggml.merges": (["h e", "Ġ t"], ARR, STR),
        "tokenizer.ggml.bos_token_id": (1, U32, None),
        "tokenizer.ggml.eos_token_id": (2, U32, None),
    }
    parts = GgufParts("llama", fields)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int) -> None:
        data = np.ones(shape) if len(shape) == 1 else rng.standard_normal(shape) * 0.02
        parts.tensors[name] = (data.astype(np.float32), None)

    add("token_embd.weight", len(tokens), hidden)
    add("output_norm.weight", hidden)
    for i in range(s["layers"]):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    return parts


def write_gguf(path: Path, parts: GgufParts) -> Path:
    writer = gguf.GGUFWriter(str(path), parts.arch)
    for key, (value, vtype, sub_type) in parts.fields.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, (data, raw_dtype) in parts.tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_case(tmp: Path, parts: GgufParts, field: str | None) -> BadModel:
    """Write ``parts`` as the case's file; the error must name it and ``field``."""
    path = write_gguf(tmp / "model.gguf", parts)
    return BadModel(path, path, field)


@bad_model
def gguf_empty(tmp: Path, sources: Sources) -> BadModel:
    path = tmp / "model.gguf"
    path.write_bytes(b"")
    return BadModel(path, path)


@bad_model
def gguf_garbage_magic(tmp: Path, sources: Sources) -> BadModel:
    path = tmp / "model.gguf"
    path.write_bytes(b"GGML" + bytes(range(256)) * 4)
    return BadModel(path, path)


@bad_model
def gguf_truncated_in_the_header(tmp: Path, sources: Sources) -> BadModel:
    path = tmp / "model.gguf"
    path.write_bytes(sources.gguf.read_bytes()[:2000])
    return BadModel(path, path)


@bad_model
def gguf_truncated_in_the_tensors(tmp: Path, sources: Sources) -> BadModel:
    path = tmp / "model.gguf"
    data = sources.gguf.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    return BadModel(path, path)


@bad_model
def gguf_architecture_unknown(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts = replace(parts, arch="gpt2")
    bad = gguf_case(tmp, parts, "general.architecture")
    return replace(bad, mentions="llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, olmo2")


@bad_model
def gguf_block_count_missing(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    del parts.fields["llama.block_count"]
    return gguf_case(tmp, parts, "llama.block_count")


@bad_model
def gguf_head_count_a_string(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.fields["llama.attention.head_count"] = ("four", STR, None)
    return gguf_case(tmp, parts, "llama.attention.head_count")


@bad_model
def gguf_heads_not_dividing_hidden(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.fields["llama.attention.head_count"] = (5, U32, None)
    return gguf_case(tmp, parts, "llama.attention.head_count")


@bad_model
def gguf_tokens_missing(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    del parts.fields["tokenizer.ggml.tokens"]
    return gguf_case(tmp, parts, "tokenizer.ggml.tokens")


@bad_model
def gguf_i32_tensor(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.tensors["blk.0.attn_norm.weight"] = (np.ones(64, dtype=np.int32), None)
    return gguf_case(tmp, parts, "blk.0.attn_norm.weight")


@bad_model
def gguf_tensor_type_without_dequantizer(tmp: Path, sources: Sources) -> BadModel:
    # Q8_K is llama.cpp's intermediate type: gguf-py has no dequantizer for it.
    parts = tiny_gguf_parts()
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    raw = np.zeros((64, 256 // block * type_size), dtype=np.uint8)
    parts.tensors["blk.1.ffn_down.weight"] = (raw, gguf.GGMLQuantizationType.Q8_K)
    return gguf_case(tmp, parts, "blk.1.ffn_down.weight")


@bad_model
def gguf_tensor_wrong_shape(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.tensors["blk.0.attn_k.weight"] = (np.zeros((48, 64), dtype=np.float32), None)
    return gguf_case(tmp, parts, "blk.0.attn_k.weight")


@bad_model
def gguf_tensor_missing(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    del parts.tensors["blk.1.ffn_up.weight"]
    return gguf_case(tmp, parts, "blk.1.ffn_up.weight")


@bad_model
def gguf_tensor_unknown(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.tensors["blk.0.attn_sinks.weight"] = (np.zeros(4, dtype=np.float32), None)
    return gguf_case(tmp, parts, "blk.0.attn_sinks.weight")


@bad_model
def gguf_value_length_not_key_length(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.fields["llama.attention.key_length"] = (16, U32, None)
    parts.fields["llama.attention.value_length"] = (32, U32, None)
    return gguf_case(tmp, parts, "llama.attention.value_length")


@bad_model
def gguf_partial_rotary_on_llama(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.fields["llama.rope.dimension_count"] = (8, U32, None)
    return gguf_case(tmp, parts, "llama.rope.dimension_count")


@bad_model
def gguf_rope_scaling_unknown(tmp: Path, sources: Sources) -> BadModel:
    parts = tiny_gguf_parts()
    parts.fields["llama.rope.scaling.type"] = ("longrope", STR, None)
    return gguf_case(tmp, parts, "llama.rope.scaling.type")


@bad_model
def gguf_llama3_rope_factors(tmp: Path, sources: Sources) -> BadModel:
    # llama.cpp keeps llama3 RoPE as per-frequency factors, without the parameters
    parts = tiny_gguf_parts()
    parts.tensors["rope_freqs.weight"] = (np.ones(8, dtype=np.float32), None)
    bad = gguf_case(tmp, parts, "rope_freqs.weight")
    return replace(bad, mentions="llama3")


@bad_model
def gguf_experts_without_a_used_count(tmp: Path, sources: Sources) -> BadModel:
    # a llama with experts is a Mixtral, which routes each token to expert_used_count
    parts = tiny_gguf_parts()
    parts.fields["llama.expert_count"] = (4, U32, None)
    return gguf_case(tmp, parts, "llama.expert_used_count")


@bad_model
def gguf_dense_layer_in_a_mixtral(tmp: Path, sources: Sources) -> BadModel:
    # a Mixtral's layers hold experts: the dense FFN of a llama is not one of its tensors
    parts = tiny_gguf_parts()
    parts.fields["llama.expert_count"] = (4, U32, None)
    parts.fields["llama.expert_used_count"] = (2, U32, None)
    return gguf_case(tmp, parts, next(name for name in parts.tensors if "ffn_gate" in name))
