"""A corpus of bad models: each a small named builder that breaks one thing in a good tiny
model and says what the load error must name. This module holds the records and the
Hugging Face folder cases; ``bad_gguf`` the GGUF file cases.

A builder gets the folder to write into and the good sources, and returns a
:class:`BadModel`: the path to load, the file the error must name, and the field or tensor
it must name (None where the fault has no field: a missing folder, an unreadable file).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True, slots=True)
class Sources:
    """The good models every builder starts from."""

    hf: Path  # a tiny Hugging Face folder with the real tokenizer
    gguf: Path  # a tiny GGUF file (small vocabulary, so it converts in about a second)


@dataclass(frozen=True, slots=True)
class BadModel:
    """What to load, and what its ``ModelLoadError`` must name."""

    model: Path
    file: Path
    field: str | None = None
    mentions: str = ""  # a word the message must hold when the field is not ours to name


Builder = Callable[[Path, Sources], BadModel]


def registry(cases: dict[str, Builder]) -> Callable[[Builder], Builder]:
    """A decorator that adds a builder to ``cases`` under its name."""

    def register(builder: Builder) -> Builder:
        cases[builder.__name__] = builder
        return builder

    return register


CASES: dict[str, Builder] = {}
"""The Hugging Face folder cases (the GGUF ones are in ``bad_gguf``)."""
bad_model = registry(CASES)


# -- helpers -----------------------------------------------------------------------------


def copy_hf(tmp: Path, sources: Sources) -> Path:
    folder = tmp / "model"
    shutil.copytree(sources.hf, folder)
    return folder


def edit_config(folder: Path, **changes: Any) -> Path:
    """Set (or, with ``None``, delete) top-level keys of ``folder/config.json``."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return path


def config_case(tmp: Path, sources: Sources, field: str, **changes: Any) -> BadModel:
    folder = copy_hf(tmp, sources)
    return BadModel(folder, edit_config(folder, **changes), field)


def weights_path(folder: Path) -> Path:
    return folder / "model.safetensors"


def edit_weights(folder: Path, name: str, tensor: torch.Tensor | None) -> Path:
    """Replace (or, with ``None``, delete) one tensor of the folder's weight file."""
    path = weights_path(folder)
    tensors = load_file(str(path))
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(path))
    return path


def safetensors_bytes(header: bytes, body: bytes = b"") -> bytes:
    """A safetensors file as its format has it: header length (u64 LE), header, data."""
    return struct.pack("<Q", len(header)) + header + body


# -- the folder --------------------------------------------------------------------------


@bad_model
def folder_missing(tmp: Path, sources: Sources) -> BadModel:
    return BadModel(tmp / "nope", tmp / "nope")


@bad_model
def folder_empty(tmp: Path, sources: Sources) -> BadModel:
    folder = tmp / "empty"
    folder.mkdir()
    return BadModel(folder, folder / "config.json")


@bad_model
def path_is_a_plain_file(tmp: Path, sources: Sources) -> BadModel:
    path = tmp / "model.bin"
    path.write_bytes(b"\0" * 64)
    return BadModel(path, path)


# -- config.json -------------------------------------------------------------------------


@bad_model
def config_missing(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    (folder / "config.json").unlink()
    return BadModel(folder, folder / "config.json")


@bad_model
def config_not_json(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    (folder / "config.json").write_text('{"model_type": "llama",')
    return BadModel(folder, folder / "config.json")


@bad_model
def config_not_an_object(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    (folder / "config.json").write_text('["llama", 64]')
    return BadModel(folder, folder / "config.json")


@bad_model
def config_is_a_folder(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    return BadModel(folder, folder / "config.json")


@bad_model
def model_type_unknown(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "model_type", model_type="gpt2")


@bad_model
def model_type_missing(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "model_type", model_type=None)


@bad_model
def architectures_unknown(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "architectures", architectures=["BertForMaskedLM"])


@bad_model
def architectures_not_a_list(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "architectures", architectures=7)


@bad_model
def hidden_size_a_string(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "hidden_size", hidden_size="64")


@bad_model
def hidden_size_zero(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "hidden_size", hidden_size=0)


@bad_model
def hidden_size_a_bool(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "hidden_size", hidden_size=True)


@bad_model
def num_layers_negative(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "num_hidden_layers", num_hidden_layers=-2)


@bad_model
def num_layers_huge(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "num_hidden_layers", num_hidden_layers=10**9)


@bad_model
def heads_not_dividing_hidden(tmp: Path, sources: Sources) -> BadModel:
    # No head_dim: it would be 64 / 5.
    changes = {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": None}
    return config_case(tmp, sources, "num_attention_heads", **changes)


@bad_model
def kv_heads_not_dividing_heads(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "num_key_value_heads", num_key_value_heads=3)


@bad_model
def kv_heads_a_word(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "num_key_value_heads", num_key_value_heads="two")


@bad_model
def head_dim_negative(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "head_dim", head_dim=-16)


@bad_model
def head_dim_odd(tmp: Path, sources: Sources) -> BadModel:
    # 4 heads x 15 = 60 query rows; RoPE rotates pairs of dimensions.
    return config_case(tmp, sources, "head_dim", head_dim=15)


@bad_model
def vocab_size_missing(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "vocab_size", vocab_size=None)


@bad_model
def vocab_size_below_tokenizer(tmp: Path, sources: Sources) -> BadModel:
    # Weights and config agree on 1000 rows; the tokenizer has 49152 tokens, so a prompt
    # could hold ids with no embedding.
    folder = copy_hf(tmp, sources)
    edit_weights(folder, "model.embed_tokens.weight", torch.zeros(1000, 64))
    return BadModel(folder, edit_config(folder, vocab_size=1000), "vocab_size")


@bad_model
def max_position_zero(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "max_position_embeddings", max_position_embeddings=0)


@bad_model
def max_position_a_word(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "max_position_embeddings", max_position_embeddings="long")


@bad_model
def max_position_huge(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "max_position_embeddings", max_position_embeddings=10**12)


@bad_model
def rms_norm_eps_a_word(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "rms_norm_eps", rms_norm_eps="small")


@bad_model
def tie_word_embeddings_a_string(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "tie_word_embeddings", tie_word_embeddings="false")


@bad_model
def eos_token_id_a_word(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "eos_token_id", eos_token_id=["</s>"])


@bad_model
def rope_theta_a_word(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "rope_theta", rope_parameters=None, rope_theta="big")


@bad_model
def rope_llama3_without_factor(tmp: Path, sources: Sources) -> BadModel:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return config_case(tmp, sources, "rope_parameters.factor", rope_parameters=rope)


@bad_model
def rope_scaling_not_an_object(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "rope_scaling", rope_parameters=None, rope_scaling="linear")


@bad_model
def config_field_only_transformers_checks(tmp: Path, sources: Sources) -> BadModel:
    # We do not read pad_token_id; transformers validates it while it loads the tokenizer.
    folder = copy_hf(tmp, sources)
    return BadModel(folder, edit_config(folder, pad_token_id="x"), mentions="pad_token_id")


@bad_model
def embedding_of_4_tib(tmp: Path, sources: Sources) -> BadModel:
    # 2**28 tokens x 4096 x 4 bytes (float32 on a CPU) = 4 TiB for the embedding alone.
    huge = {
        "vocab_size": 2**28,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 11008,
    }
    return config_case(tmp, sources, "vocab_size", **huge)


# -- the weights -------------------------------------------------------------------------


@bad_model
def weights_missing(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    weights_path(folder).unlink()
    return BadModel(folder, folder)


@bad_model
def weights_truncated(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    path = weights_path(folder)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return BadModel(folder, path)


@bad_model
def weights_empty(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    weights_path(folder).write_bytes(b"")
    return BadModel(folder, weights_path(folder))


@bad_model
def weights_header_not_json(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    weights_path(folder).write_bytes(safetensors_bytes(b"{not json at all}"))
    return BadModel(folder, weights_path(folder))


@bad_model
def weights_header_past_the_file(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    header = b'{"__metadata__": {}}'
    weights_path(folder).write_bytes(struct.pack("<Q", 1 << 40) + header)
    return BadModel(folder, weights_path(folder))


@bad_model
def weights_data_past_the_file(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    entry = {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}
    header = json.dumps({"model.norm.weight": entry}).encode()
    weights_path(folder).write_bytes(safetensors_bytes(header, b"\0" * 16))
    return BadModel(folder, weights_path(folder))


@bad_model
def weights_file_is_a_folder(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    path = folder / "extra.safetensors"
    path.mkdir()
    return BadModel(folder, path)


@bad_model
def tensor_missing(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    edit_weights(folder, "model.layers.0.mlp.up_proj.weight", None)
    return BadModel(folder, folder, "layers.0.mlp.gate_up_proj.weight[up]")


@bad_model
def tensor_wrong_shape(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    name = "model.layers.1.self_attn.k_proj.weight"
    return BadModel(folder, edit_weights(folder, name, torch.zeros(3, 3)), name)


@bad_model
def tensor_integer_dtype(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    name = "model.norm.weight"
    return BadModel(folder, edit_weights(folder, name, torch.ones(64, dtype=torch.int32)), name)


@bad_model
def tensor_float64(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    name = "model.norm.weight"
    return BadModel(folder, edit_weights(folder, name, torch.ones(64, dtype=torch.float64)), name)


@bad_model
def tensor_of_a_layer_past_the_last(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    name = "model.layers.7.mlp.up_proj.weight"
    return BadModel(folder, edit_weights(folder, name, torch.zeros(128, 64)), name)


def _sharded(folder: Path) -> tuple[Path, dict[str, str]]:
    """Rename the weights to shard 1 of 2 and map every tensor to it in an index."""
    shard = folder / "model-00001-of-00002.safetensors"
    weights_path(folder).rename(shard)
    names = list(load_file(str(shard)))
    return folder / "model.safetensors.index.json", dict.fromkeys(names, shard.name)


@bad_model
def index_names_a_missing_shard(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    index, weight_map = _sharded(folder)
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return BadModel(folder, index, "model.norm.weight")


@bad_model
def index_not_json(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    index, _ = _sharded(folder)
    index.write_text('{"weight_map": ')
    return BadModel(folder, index)


# -- the tokenizer -----------------------------------------------------------------------


@bad_model
def tokenizer_missing(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return BadModel(folder, folder, mentions=f"no tokenizer in {folder}; pass tokenizer=")


@bad_model
def tokenizer_vocab_without_merges(tmp: Path, sources: Sources) -> BadModel:
    # transformers, given a BPE vocabulary alone, asks for sentencepiece or tiktoken.
    folder = copy_hf(tmp, sources)
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.json").write_text('{"a": 0}')
    return BadModel(folder, folder, mentions=f"no tokenizer in {folder}; pass tokenizer=")


@bad_model
def tokenizer_json_not_json(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    path = folder / "tokenizer.json"
    path.write_text(path.read_text()[:1000])
    return BadModel(folder, path)


@bad_model
def tokenizer_json_wrong_structure(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    path = folder / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
    return BadModel(folder, path)


@bad_model
def tokenizer_config_not_json(tmp: Path, sources: Sources) -> BadModel:
    folder = copy_hf(tmp, sources)
    path = folder / "tokenizer_config.json"
    path.write_text("{'single': 'quotes'}")
    return BadModel(folder, path)


# -- the families' own fields -------------------------------------------------------------


@bad_model
def layer_types_of_the_wrong_length(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "gemma2", "sliding_window": 8, "layer_types": ["full_attention"]}
    return config_case(tmp, sources, "layer_types", **changes)


@bad_model
def layer_types_unknown_kind(tmp: Path, sources: Sources) -> BadModel:
    kinds = ["sliding_attention", "chunked_attention"]
    return config_case(tmp, sources, "layer_types", model_type="qwen3", layer_types=kinds)


@bad_model
def sliding_layers_without_a_window(tmp: Path, sources: Sources) -> BadModel:
    kinds = ["sliding_attention", "full_attention"]
    changes = {"model_type": "qwen3", "layer_types": kinds, "sliding_window": None}
    return config_case(tmp, sources, "sliding_window", **changes)


@bad_model
def more_experts_per_token_than_experts(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}
    return config_case(tmp, sources, "num_experts_per_tok", **changes)


@bad_model
def moe_without_expert_size(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
    return config_case(tmp, sources, "moe_intermediate_size", **changes)


@bad_model
def mlp_only_layers_not_ints(tmp: Path, sources: Sources) -> BadModel:
    changes = {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "mlp_only_layers": ["first"],
    }
    return config_case(tmp, sources, "mlp_only_layers", **changes)


@bad_model
def query_scale_a_string(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "gemma2", "query_pre_attn_scalar": "256"}
    return config_case(tmp, sources, "query_pre_attn_scalar", **changes)


@bad_model
def soft_cap_negative(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "gemma2", "attn_logit_softcapping": -50.0}
    return config_case(tmp, sources, "attn_logit_softcapping", **changes)


@bad_model
def gemma_activation_unknown(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "gemma2", "hidden_activation": "relu"}
    return config_case(tmp, sources, "hidden_activation", **changes)


@bad_model
def partial_rotary_past_one(tmp: Path, sources: Sources) -> BadModel:
    return config_case(
        tmp, sources, "partial_rotary_factor", model_type="phi3", partial_rotary_factor=1.5
    )


@bad_model
def longrope_factors_of_the_wrong_length(tmp: Path, sources: Sources) -> BadModel:
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}
    changes = {
        "model_type": "phi3",
        "rope_parameters": rope,
        "original_max_position_embeddings": 64,
    }
    return config_case(tmp, sources, "rope_parameters.short_factor", **changes)


@bad_model
def no_rope_layers_of_the_wrong_length(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "no_rope_layers", model_type="smollm3", no_rope_layers=[1])


@bad_model
def granite_multiplier_zero(tmp: Path, sources: Sources) -> BadModel:
    changes = {"model_type": "granite", "residual_multiplier": 0}
    return config_case(tmp, sources, "residual_multiplier", **changes)


@bad_model
def layer_count_past_the_cap(tmp: Path, sources: Sources) -> BadModel:
    return config_case(tmp, sources, "num_hidden_layers", num_hidden_layers=5000)
