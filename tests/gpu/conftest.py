"""Session-wide transformers references, computed once: loading the reference model and
running its greedy ``generate`` dominate the model tests' time on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.reference import PROMPTS, load_reference, reference_greedy

REFERENCE_NEW_TOKENS = 32
GreedyReference = Callable[[Path], list[list[int]]]


@pytest.fixture(scope="session")
def greedy_reference(tokenizer: Any) -> GreedyReference:
    """``greedy_reference(folder)``: transformers' 32 greedy tokens for each of ``PROMPTS``."""
    cache: dict[Path, list[list[int]]] = {}

    def get(folder: Path) -> list[list[int]]:
        if folder not in cache:
            ref = load_reference(folder)
            prompts = [tokenizer(p).input_ids for p in PROMPTS]
            cache[folder] = [reference_greedy(ref, ids, REFERENCE_NEW_TOKENS) for ids in prompts]
        return cache[folder]

    return get
