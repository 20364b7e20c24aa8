"""Session-wide models and transformers references, each built once: loading a model
(the default one is 0.5 GB of float32) and running the reference's greedy ``generate``
dominate the model tests' time on a CPU."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inlinelm.gpu.model.models.decoder import DecoderModel
from tests.gpu.fakes import fake_flashinfer_module
from tests.gpu.reference import PROMPTS, load_ours, load_reference, reference_greedy

REFERENCE_NEW_TOKENS = 32
GreedyReference = Callable[[Path], list[list[int]]]
OursModel = Callable[[Path], DecoderModel]
ReferenceModel = Callable[[Path], Any]


@pytest.fixture(scope="session")
def ours_model() -> OursModel:
    """``ours_model(folder)``: our float32 CPU model of ``folder`` (:func:`load_ours`),
    loaded once per session; tests only run it (each driver brings its own KV cache)."""
    return functools.cache(load_ours)


@pytest.fixture(scope="session")
def reference_model() -> ReferenceModel:
    """``reference_model(folder)``: the transformers model of ``folder``, loaded once per
    session; a test that changes a weight puts the original back before it ends."""
    return functools.cache(load_reference)


@pytest.fixture(scope="session")
def greedy_reference(tokenizer: Any, reference_model: ReferenceModel) -> GreedyReference:
    """``greedy_reference(folder)``: transformers' 32 greedy tokens for each of ``PROMPTS``."""
    cache: dict[Path, list[list[int]]] = {}

    def get(folder: Path) -> list[list[int]]:
        if folder not in cache:
            ref = reference_model(folder)
            prompts = [tokenizer(p).input_ids for p in PROMPTS]
            cache[folder] = [reference_greedy(ref, ids, REFERENCE_NEW_TOKENS) for ids in prompts]
        return cache[folder]

    return get


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import flashinfer`` gives the CPU stand-in of :mod:`tests.gpu.fakes` (the model's
    kernels and the attention wrappers), with a small attention workspace."""
    from inlinelm.gpu.attention import flashinfer_backend

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer_module())
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)
