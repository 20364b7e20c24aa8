"""Every bad model in the corpus is a ``ModelLoadError`` naming the file and the field at
fault, through the path ``Engine.start`` takes; an oversized one is refused before any of
it is allocated."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inlinelm import Engine
from inlinelm.config import EngineConfig
from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.model_files import check_model
from inlinelm.runtime.loader import load_engine
from tests.gpu.loading import bad_gguf, bad_models
from tests.gpu.loading.bad_gguf import tiny_gguf_parts, write_gguf
from tests.gpu.loading.bad_models import Sources, embedding_of_4_tib

CORPUS = {**bad_models.CASES, **bad_gguf.CASES}


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Sources:
    """The good models (builders copy them, never write into them)."""
    gguf = write_gguf(tmp_path_factory.mktemp("good-gguf") / "tiny.gguf", tiny_gguf_parts())
    return Sources(tiny_model_dir, gguf)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh GGUF conversion cache for the test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("INLINELM_CACHE", str(folder))
    return folder


def start(model: Path) -> None:
    engine = Engine(model=str(model), num_threads=1, max_num_seqs=2)
    try:
        engine.start_sync()
    finally:
        engine.close()


@pytest.mark.parametrize("model", ["hf", "gguf"])
def test_the_good_sources_load(model: str, sources: Sources, cache: Path) -> None:
    # Each builder breaks one thing in these; they must load as they are.
    start(getattr(sources, model))


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bad_model_is_a_model_load_error(
    name: str, tmp_path: Path, sources: Sources, cache: Path
) -> None:
    bad = CORPUS[name](tmp_path, sources)
    with pytest.raises(ModelLoadError) as info:
        start(bad.model)
    assert (info.value.path, info.value.field) == (str(bad.file), bad.field), str(info.value)
    assert bad.mentions in str(info.value)
    assert not list(cache.glob("*/DONE")), "a failed conversion is not cached"


@pytest.mark.parametrize(
    "name",
    [
        "config_not_an_object",
        "heads_not_dividing_hidden",
        "rope_llama3_without_factor",
        "index_names_a_missing_shard",
        "weights_file_is_a_folder",
        "gguf_architecture_unknown",
        "gguf_block_count_missing",
    ],
)
def test_serve_checks_refuse_a_bad_folder_without_loading(
    name: str, tmp_path: Path, sources: Sources
) -> None:
    # `inlinelm serve` calls check_model before it starts the server (a GGUF: its header).
    bad = CORPUS[name](tmp_path, sources)
    with pytest.raises(ModelLoadError) as info:
        check_model(str(bad.model))
    assert (info.value.path, info.value.field) == (str(bad.file), bad.field), str(info.value)


class TensorAllocations(TorchDispatchMode):
    """The largest tensor storage torch creates while the mode is on (in this thread);
    meta tensors hold no memory and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self.largest = max(self.largest, leaf.untyped_storage().nbytes())
        return out


def test_an_oversized_model_is_refused_before_allocating(tmp_path: Path, sources: Sources) -> None:
    bad = embedding_of_4_tib(tmp_path, sources)
    # The smallest thing the runner allocates for this config is its rotary table
    # (2048 positions x head_dim 128 x 4 bytes = 1 MiB; the weights are 12 TiB): a refusal
    # made before any allocation stays below it, in torch and in Python alike.
    bound = 2048 * 128 * 4
    allocations = TensorAllocations()
    with allocations:  # NOTE: entering a mode the first time imports; not measured.
        torch.zeros(1)
    config = EngineConfig(model=str(bad.model), num_threads=1, max_num_seqs=2)
    tracemalloc.start()
    try:
        with allocations, pytest.raises(ModelLoadError) as info:
            # In this thread (a dispatch mode is per thread): what Engine.start runs.
            load_engine(config, lambda outputs: None)
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (info.value.path, info.value.field) == (str(bad.file), "vocab_size")
    assert "TiB" in str(info.value)
    assert allocations.largest < bound
    assert python_peak < bound
