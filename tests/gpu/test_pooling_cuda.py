"""Embeddings, scores and prompt logprobs on CUDA (bfloat16) against the CPU engine
(float32): an encoder's ragged batch, a decoder embedder's chunked prompts, a
cross-encoder, and a decoder's prompt logprobs. Their CPU twins
(``benchmarks/gpu_stages.py``'s ``CPU_TWINS``) run the same paths on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine, SamplingParams
from tests.pooling import builders
from tests.runtime.helpers import run

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a"]
BF16_ATOL = 5e-2
"""bfloat16 keeps 8 bits of mantissa (relative step 2**-8 = 4e-3); a few layers of
rounding on unit-scale values stay well inside 5e-2, as the CUDA logits tests allow."""


def _both(folder: Path, call: Any, device: str, **options: Any) -> tuple[Any, Any]:
    async def main(device: str) -> Any:
        async with Engine(model=str(folder), device=device, **options) as engine:
            return await call(engine)

    return run(main("cpu")), run(main(device))


@pytest.mark.gpu
def test_embeddings_and_scores_on_cuda_equal_the_cpu(tmp_path: Path) -> None:
    embeddings_and_scores_equal_the_cpu(tmp_path, "cuda")


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_equal_the_cpu(tiny_model_dir: Path) -> None:
    prompt_logprobs_equal_the_cpu(tiny_model_dir, "cuda")


def test_the_cuda_comparisons_run_on_a_cpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The two comparisons above, with the CPU in CUDA's place: their code runs here."""
    embeddings_and_scores_equal_the_cpu(tmp_path, "cpu")
    prompt_logprobs_equal_the_cpu(tiny_model_dir, "cpu")


def embeddings_and_scores_equal_the_cpu(tmp_path: Path, device: str) -> None:
    for folder in (
        builders.make_bert(tmp_path / "bert", sentence_transformers="mean", normalize=True),
        builders.make_modernbert(tmp_path / "mbert", sentence_transformers="cls"),
        builders.make_qwen3_embedder(tmp_path / "qwen3"),
    ):
        cpu, cuda = _both(folder, lambda e: e.embed(TEXTS), device, max_num_batched_tokens=16)
        got = torch.tensor([o.embedding for o in cuda])
        want = torch.tensor([o.embedding for o in cpu])
        torch.testing.assert_close(got, want, rtol=0, atol=BF16_ATOL)
    cross = builders.make_bert_cross_encoder(tmp_path / "cross")
    cpu, cuda = _both(cross, lambda e: e.score("fox", TEXTS), device)
    for a, b in zip(cpu, cuda, strict=True):
        assert abs(a.score - b.score) <= BF16_ATOL


def prompt_logprobs_equal_the_cpu(tiny_model_dir: Path, device: str) -> None:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    cpu, cuda = _both(
        tiny_model_dir, lambda e: e.stream(TEXTS[1], params), device, max_num_batched_tokens=16
    )
    assert len(cuda.prompt_logprobs) == len(cpu.prompt_logprobs)
    for a, b in zip(cpu.prompt_logprobs[1:], cuda.prompt_logprobs[1:], strict=True):
        assert a.token_ids == b.token_ids
        # NOTE: a logprob of a random model's ~uniform 49k vocabulary is ~-10.8: bfloat16's
        # relative step on it is ~4e-2
        assert abs(a.logprobs[0] - b.logprobs[0]) <= 0.2
