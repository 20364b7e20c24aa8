"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``): each prompt token's logprob
under the model, computed during prefill, equal to transformers' log-softmax over the
prompt; in chunks, beside other requests, and with a cached prefix on the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine, RequestError, SamplingParams
from inlinelm.gpu.model.registry import read_model_config
from tests.gpu.reference import load_reference, logits_atol
from tests.runtime.helpers import run

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs away into the woods. " * 3


def _reference(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logprobs of every position ``[len(ids), V]`` (row j predicts j+1)."""
    model = load_reference(folder)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits, torch.log_softmax(logits, dim=-1)


def _check(out: Any, ids: list[int], expected: torch.Tensor, atol: float, k: int) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None  # nothing predicts the first token
    for j in range(1, len(ids)):
        entry = entries[j]
        row = expected[j - 1]
        assert entry.token_ids[0] == ids[j]
        assert abs(entry.logprobs[0] - row[ids[j]].item()) <= atol
        assert (
            entry.sampled_rank == int((row > row[ids[j]]).sum()) + 1
            or abs(row.sort(descending=True).values[entry.sampled_rank - 1] - row[ids[j]]) <= atol
        )  # NOTE: a near-tie may rank either way within the rounding
        top_ids, top_lps = entry.token_ids[1:], entry.logprobs[1:]
        assert len(top_ids) == k
        want = row.topk(k)
        for got_lp, want_lp in zip(top_lps, want.values.tolist(), strict=True):
            assert abs(got_lp - want_lp) <= atol
        for tid, lp in zip(top_ids, top_lps, strict=True):
            assert abs(row[tid].item() - lp) <= atol


def test_prompt_logprobs_equal_transformers_in_chunks_beside_other_requests(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    logits, expected = _reference(tiny_model_dir, ids)
    # NOTE: a logprob is a logit minus the log-sum-exp of them all: twice a logit's error.
    atol = 2 * logits_atol(read_model_config(tiny_model_dir), logits)

    async def main() -> None:
        # a 16-token budget splits the prompt over several steps, next to a plain request
        async with Engine(model=str(tiny_model_dir), max_num_batched_tokens=16) as engine:
            greedy = SamplingParams(max_tokens=4, temperature=0)
            plain_alone = await engine.stream("Hello there", greedy)
            plain = engine.stream("Hello there", greedy)
            asked = engine.stream(PROMPT, greedy.with_overrides(prompt_logprobs=3))
            out, beside = await asked, await plain
            _check(out, ids, expected, atol, 3)
            assert out.token_ids == (await engine.stream(PROMPT, greedy)).token_ids
            assert beside.token_ids == plain_alone.token_ids
            assert beside.prompt_logprobs is None and plain_alone.prompt_logprobs is None

    run(main())


def test_a_cached_prefix_does_not_drop_prompt_logprobs(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """A request with prompt logprobs skips the prefix cache (its cached positions' logits
    were never kept), so it gets every entry; a plain request still hits the cache."""
    ids = tokenizer(PROMPT)["input_ids"]
    logits, expected = _reference(tiny_model_dir, ids)
    atol = 2 * logits_atol(read_model_config(tiny_model_dir), logits)

    async def main() -> None:
        async with Engine(model=str(tiny_model_dir), block_size=16) as engine:
            greedy = SamplingParams(max_tokens=2, temperature=0)
            await engine.stream(PROMPT, greedy)
            hit = await engine.stream(PROMPT, greedy)
            assert hit.num_cached_tokens >= 16  # the prefix is in the cache
            out = await engine.stream(PROMPT, greedy.with_overrides(prompt_logprobs=0))
            assert out.num_cached_tokens == 0
            _check(out, ids, expected, atol, 0)

    run(main())


def test_prompt_logprobs_of_a_one_token_prompt_is_one_none(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with Engine(model=str(tiny_model_dir)) as engine:
            out = await engine.stream([5], SamplingParams(max_tokens=1, prompt_logprobs=2))
            assert out.prompt_logprobs == [None]

    run(main())


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_prompt_logprobs_are_refused(value: object) -> None:
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]  # the test's point


def test_prompt_logprobs_past_the_engine_cap_are_refused(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with Engine(model=str(tiny_model_dir), max_logprobs=5) as engine:
            with pytest.raises(RequestError, match="prompt_logprobs must be at most 5"):
                await engine.stream("hi", SamplingParams(prompt_logprobs=6))

    run(main())
