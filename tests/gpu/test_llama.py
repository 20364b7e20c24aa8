"""Our Llama-family model against transformers: prefill logits and batched greedy decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.conftest import GreedyReference
from tests.gpu.reference import (
    PROMPTS,
    PagedGreedyDriver,
    load_ours,
    load_reference,
    prefill_logits,
)


@pytest.fixture(params=["tiny", "default"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"{request.param}_model_dir"))


def test_prefill_logits_match_transformers(model_dir: Path, tokenizer: Any) -> None:
    ours, ref = load_ours(model_dir), load_reference(model_dir)
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=1e-4, atol=1e-4)


def test_batched_chunked_greedy_matches_transformers(
    model_dir: Path, tokenizer: Any, greedy_reference: GreedyReference
) -> None:
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    got = PagedGreedyDriver(load_ours(model_dir)).generate(prompts, max_new_tokens=32, chunk=7)
    assert got == greedy_reference(model_dir)


def test_default_model_answers_sensibly(default_model_dir: Path, tokenizer: Any) -> None:
    """The dequantized GGUF is a working model, not just one that matches itself."""
    ours = load_ours(default_model_dir)
    ids = tokenizer("The capital of France is").input_ids
    text = tokenizer.decode(PagedGreedyDriver(ours).generate([ids], max_new_tokens=8, chunk=64)[0])
    assert "Paris" in text
