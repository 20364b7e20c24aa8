"""Convert a GGUF file into the Hugging Face files transformers would save of its model:
config.json, safetensors shards (float32, or GGUF blocks for the matrices the file holds
quantized) and the tokenizer files.

The steps are one module each: the header (``gguf_header``: the family and its config
fields, from ``gguf_config``), the names (``gguf_names``), the tensors (``gguf_tensors``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.gguf_header import GgufHeader, open_gguf, read_header
from inlinelm.gpu.loading.gguf_names import TensorNames
from inlinelm.gpu.loading.gguf_tensors import check_room, check_tensors, write_tensors
from inlinelm.gpu.loading.quantization import GGUF_TYPES_FILE
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.registry import parse_config
from inlinelm.progress import progress_bar

logger = logging.getLogger(__name__)

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


def convert_gguf(path: Path, out: Path, *, quantized: bool = False) -> dict[str, str]:
    """Write config.json, the weights and the tokenizer files of ``path`` into ``out``,
    and generation_config.json when the file recommends sampling values. The weights are
    float32, or with ``quantized`` the file's quantized matrices as the blocks the engine
    computes with (:func:`~.gguf_tensors.write_tensors`).

    Everything the header tells is checked before a tensor is dequantized: the
    architecture and the metadata keys the config is built from, every tensor's name,
    shape and type, and the memory and disk the conversion needs. Raises
    ``ModelLoadError`` naming the file and the key or tensor at fault. Returns the weight
    map of the shards (each tensor's file), for the index the caller writes.
    """
    # NOTE: reading the header (gguf's reader) and transformers' config from it take
    # seconds each for a large vocabulary: a one-step bar says what runs (as for the
    # tokenizer, and the dequantizing's own bar).
    with progress_bar(1, f"reading {path.name}'s metadata (once)") as bar:
        reader = open_gguf(path)
        header = read_header(reader, path)
        write_config(path, out, header)
        bar.update(1)
    names = TensorNames(header.family)
    check_tensors(reader, path, header, names)
    check_room(reader, path, out, quantized=quantized)
    types, weight_map = write_tensors(reader, path, header, names, out, quantized=quantized)
    (out / GGUF_TYPES_FILE).write_text(json.dumps(types, indent=1, sort_keys=True))
    _convert_tokenizer(path, out)
    generation = _sampling_fields(reader) or dict(MODEL_CARD_SAMPLING.get(_identity(reader), {}))
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return weight_map


def write_config(path: Path, out: Path, header: GgufHeader) -> ModelConfig:
    """Write ``out/config.json`` and check it as any config.json (errors name the GGUF file).

    The header's fields (``gguf_config``) are the whole config: the family's transformers
    config class saves them, as it saves any checkpoint's. (transformers' own GGUF config
    reading is not used: it took 3-8 s a file here and, once every field it gets wrong was
    replaced by ours, added only the unknown token's id.)
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = dict(header.fields)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    config.save_pretrained(str(out))
    return parse_config(json.loads((out / "config.json").read_text()), str(path))


def _convert_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer files of ``path``: transformers' tokenizer built from the file's
    ``tokenizer.ggml.*`` keys alone (its model, pre-tokenizer, vocabulary, merges, special
    tokens, chat template), as llama.cpp reads them, whatever the architecture.

    NOTE: not ``AutoTokenizer``: it reads transformers' GGUF config first (seconds for a
    large vocabulary, an error for an architecture it does not know), then wraps the
    tokenizer in the class it pairs with the config's family, which may re-split the text
    its own way (Qwen2's and Gemma's do) where the file says otherwise.
    """
    from transformers import TokenizersBackend

    logger.info("converting the tokenizer of %s (once)", path.name)
    with progress_bar(1, f"converting the tokenizer of {path.name} (once)") as bar:
        try:
            tokenizer = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
        # NOTE: the boundary of transformers' GGUF tokenizer conversion (see write_config).
        except Exception as e:
            raise ModelLoadError(
                f"transformers cannot build the tokenizer from its tokenizer.ggml.* keys "
                f"({type(e).__name__}: {e})",
                path=str(path),
            ) from e
        tokenizer.save_pretrained(str(out))
        bar.update(1)


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
