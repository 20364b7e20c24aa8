"""Dequantize a Llama-family GGUF file into Hugging Face files (safetensors, config, tokenizer)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inlinelm.errors import ModelLoadError
from inlinelm.progress import progress_bar

logger = logging.getLogger(__name__)

_SUPPORTED_ARCHS = {"llama": True, "qwen2": False}  # arch -> llama.cpp permuted Q/K rows
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
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's recommended-sampling keys -> generation_config.json keys
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def convert_gguf(path: Path, out: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files of ``path`` into ``out``,
    and generation_config.json when the file recommends sampling values."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"not a readable GGUF file ({e})", path=str(path)) from e
    arch = _field_str(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}", path=str(path), field="general.architecture"
        )
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.save_pretrained(str(out))
    tensors = _dequantize_all(reader, path, config, permuted=_SUPPORTED_ARCHS[arch])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
    generation = _sampling_fields(reader)
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _sampling_fields(reader: object) -> dict[str, Any]:
    """The ``general.sampling.*`` values of the file, under generation_config.json names."""
    values: dict[str, Any] = {}
    for key, name in _SAMPLING_KEYS.items():
        field = reader.fields.get(key)  # type: ignore[attr-defined]
        if field is not None and field.data:
            values[name] = field.parts[field.data[0]].tolist()[0]
    return values


def _field_str(reader: object, key: str) -> str:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _dequantize_all(
    reader: object, path: Path, config: object, *, permuted: bool
) -> dict[str, torch.Tensor]:
    import gguf

    num_heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
    num_kv_heads = int(config.num_key_value_heads)  # type: ignore[attr-defined]
    tensors: dict[str, torch.Tensor] = {}
    items = list(reader.tensors)  # type: ignore[attr-defined]
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


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in the Q/K projection rows."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
