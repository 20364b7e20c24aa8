"""Dequantize a Llama-family GGUF file into Hugging Face files (safetensors, config, tokenizer)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.gguf_header import SUPPORTED_GGUF_ARCHS, check_metadata, open_gguf
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.registry import parse_config
from inlinelm.gpu.model_memory import format_bytes, host_memory_available
from inlinelm.progress import progress_bar

logger = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_WEIGHTS = tuple(name for name in _LAYER_NAMES if name.endswith(".weight"))
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_FLOAT32 = 4
# llama.cpp's recommended-sampling keys -> generation_config.json keys
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

DEFAULT_MODEL_GENERATION: Mapping[str, Any] = {"temperature": 0.2, "top_p": 0.9}
"""Sampling defaults of the default model: its model card's (its GGUF carries none). Its
file gets them however it is named, ``"default"`` or its path."""

MODEL_CARD_SAMPLING: Mapping[tuple[str, str, str, str], Mapping[str, Any]] = {
    # SmolLM2-135M-Instruct, the default model
    ("HuggingFaceTB", "smollm2", "135M", "8k-lc100k-mix1-ep2"): DEFAULT_MODEL_GENERATION,
}
"""Sampling values recommended by the model cards of files that carry no
``general.sampling.*`` keys, keyed by their ``general.organization``, ``basename``,
``size_label`` and ``finetune``: one rule, whatever path or name the file is given by."""


def convert_gguf(path: Path, out: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files of ``path`` into ``out``,
    and generation_config.json when the file recommends sampling values.

    Everything the header tells is checked before a tensor is dequantized: the
    architecture and the metadata keys the config is built from, every tensor's name,
    shape and type, and the memory and disk the float32 copy needs. Raises
    ``ModelLoadError`` naming the file and the key or tensor at fault.
    """
    from safetensors.torch import save_file

    # NOTE: reading the header (gguf's reader) and transformers' config from it take
    # seconds each for a large vocabulary: a one-step bar says what runs (as for the
    # tokenizer, and the dequantizing's own bar).
    with progress_bar(1, f"reading {path.name}'s metadata (once)") as bar:
        reader = open_gguf(path)
        arch = check_metadata(reader, path)
        cfg = _convert_config(path, out)
        bar.update(1)
    _check_tensors(reader, path, cfg)
    _check_room(reader, path, out)
    tensors = _dequantize_all(reader, path, cfg, permuted=SUPPORTED_GGUF_ARCHS[arch])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _convert_tokenizer(path, out)
    generation = _sampling_fields(reader) or dict(MODEL_CARD_SAMPLING.get(_identity(reader), {}))
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _convert_config(path: Path, out: Path) -> ModelConfig:
    """Write transformers' config of the file into ``out`` and check it as any config.json
    (errors name the GGUF file)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    # NOTE: the boundary of transformers' GGUF reader (its own errors and huggingface_hub's
    # validation errors); our checks above name the common faults first.
    except Exception as e:
        raise ModelLoadError(
            f"transformers cannot read its metadata ({type(e).__name__}: {e})", path=str(path)
        ) from e
    config.save_pretrained(str(out))
    return parse_config(json.loads((out / "config.json").read_text()), str(path))


def _convert_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer files of ``path``. transformers builds them from the vocabulary and
    merges in one call that shows nothing for seconds (~10 s for a 49k vocabulary on these
    2-core machines), so a one-step bar says what runs and, once done, how long it took."""
    from transformers import AutoTokenizer

    logger.info("converting the tokenizer of %s (once)", path.name)
    with progress_bar(1, f"converting the tokenizer of {path.name} (once)") as bar:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # NOTE: the boundary of transformers' GGUF tokenizer conversion (see _convert_config).
        except Exception as e:
            raise ModelLoadError(
                f"transformers cannot build the tokenizer from its tokenizer.ggml.* keys "
                f"({type(e).__name__}: {e})",
                path=str(path),
            ) from e
        tokenizer.save_pretrained(str(out))
        bar.update(1)


def _check_tensors(reader: Any, path: Path, cfg: ModelConfig) -> None:
    """Every tensor known, shaped as the metadata says, of a type gguf can dequantize; and
    every tensor the model needs present."""
    dequantizable: dict[Any, bool] = {}
    for t in reader.tensors:
        _hf_name(t.name, path)
        expected = _expected_shape(t.name, cfg)
        if expected is None:
            raise ModelLoadError(
                f"a tensor of a layer past block_count {cfg.num_layers}",
                path=str(path),
                field=t.name,
            )
        # NOTE: GGUF lists dimensions innermost first; numpy and torch outermost first.
        shape = tuple(reversed([int(d) for d in t.shape]))
        if shape != expected:
            raise ModelLoadError(
                f"tensor shape {shape}, but the metadata makes it {expected}",
                path=str(path),
                field=t.name,
            )
        if not dequantizable.setdefault(t.tensor_type, _can_dequantize(t.tensor_type)):
            raise ModelLoadError(
                f"tensor type {t.tensor_type.name} has no dequantizer in gguf-py (not a weight "
                "type inlinelm can convert)",
                path=str(path),
                field=t.name,
            )
    present = {t.name for t in reader.tensors}
    missing = next((name for name in _required_tensors(cfg) if name not in present), None)
    if missing is not None:
        raise ModelLoadError("a tensor the model needs is missing", path=str(path), field=missing)


def _check_room(reader: Any, path: Path, out: Path) -> None:
    """Refuse a conversion whose float32 tensors cannot fit the memory or the cache disk:
    they are all held in memory, then written out."""
    sizes = [int(t.n_elements) * _FLOAT32 for t in reader.tensors]
    total = sum(sizes)
    # the tensors, plus one dequantized and one copied tensor on their way in
    need = total + 2 * max(sizes, default=0)
    available = host_memory_available()
    if available is not None and need > available:
        raise ModelLoadError(
            f"converting it to float32 needs {format_bytes(need)} of memory, and this machine "
            f"has {format_bytes(available)} available",
            path=str(path),
        )
    free_disk = shutil.disk_usage(out).free
    if total > free_disk:
        raise ModelLoadError(
            f"its float32 copy needs {format_bytes(total)} of disk in {out.parent}, which has "
            f"{format_bytes(free_disk)} free (INLINELM_CACHE chooses the folder)",
            path=str(path),
        )


def _can_dequantize(tensor_type: Any) -> bool:
    """Whether gguf-py has a dequantizer for ``tensor_type``: tried on one zero block."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _expected_shape(name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """The (numpy-order) shape the config gives a GGUF tensor; None for a layer past the
    last. Assumes ``name`` is known (``_hf_name`` passed)."""
    if name == "output_norm.weight":
        return (cfg.hidden_size,)
    if name in _GLOBAL_NAMES:
        return (cfg.vocab_size, cfg.hidden_size)
    match = _BLOCK.match(name)
    assert match is not None, "_hf_name accepted the name"
    if int(match.group(1)) >= cfg.num_layers:
        return None
    return _layer_shapes(cfg)[match.group(2)]


def _required_tensors(cfg: ModelConfig) -> Iterator[str]:
    """The GGUF tensors the model cannot do without, layer by layer (lazily: a hostile
    block_count must not build a list of a billion names)."""
    yield "token_embd.weight"
    yield "output_norm.weight"
    if not cfg.tie_word_embeddings:
        yield "output.weight"
    biases = ("attn_q.bias", "attn_k.bias", "attn_v.bias") if cfg.attention_bias else ()
    for i in range(cfg.num_layers):
        for suffix in (*_LAYER_WEIGHTS, *biases):
            yield f"blk.{i}.{suffix}"


def _identity(reader: Any) -> tuple[str, str, str, str]:
    """The file's organization, basename, size label and finetune (empty when absent)."""
    keys = ("organization", "basename", "size_label", "finetune")
    values = []
    for key in keys:
        field = reader.fields.get(f"general.{key}")
        values.append(str(field.contents()) if field is not None and field.data else "")
    return values[0], values[1], values[2], values[3]


def _sampling_fields(reader: Any) -> dict[str, Any]:
    """The ``general.sampling.*`` values of the file, under generation_config.json names."""
    values: dict[str, Any] = {}
    for key, name in _SAMPLING_KEYS.items():
        field = reader.fields.get(key)
        if field is not None and field.data:
            values[name] = field.parts[field.data[0]].tolist()[0]
    return values


def _dequantize_all(
    reader: Any, path: Path, cfg: ModelConfig, *, permuted: bool
) -> dict[str, torch.Tensor]:
    import gguf

    num_heads, num_kv_heads = cfg.num_heads, cfg.num_kv_heads
    tensors: dict[str, torch.Tensor] = {}
    items = list(reader.tensors)
    total = sum(int(t.n_bytes) for t in items)
    done = 0
    desc = f"converting {path.name} (once)"
    with progress_bar(total, desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for i, t in enumerate(items):
            name = _hf_name(t.name, path)
            array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if permuted and name.endswith("q_proj.weight"):
                array = _unpermute(array, num_heads)
            elif permuted and name.endswith("k_proj.weight"):
                array = _unpermute(array, num_kv_heads)
            tensors[name] = torch.from_numpy(array.copy())
            done += int(t.n_bytes)
            bar.update(int(t.n_bytes))
            if i % 40 == 0 or i == len(items) - 1:
                logger.info(
                    "dequantized %d/%d tensors (%.1f/%.1f MiB)",
                    i + 1,
                    len(items),
                    done / 2**20,
                    total / 2**20,
                )
    return tensors


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ModelLoadError(f"unexpected GGUF tensor {name!r}", path=str(path), field=name)


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The (numpy-order) shape of each per-layer GGUF tensor under ``cfg``."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_output.weight": (h, q),
        "ffn_gate.weight": (inter, h),
        "ffn_up.weight": (inter, h),
        "ffn_down.weight": (h, inter),
    }


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in the Q/K projection rows."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
