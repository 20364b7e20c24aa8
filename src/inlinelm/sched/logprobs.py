"""The logprobs record of one position, shared by the request (its prompt's) and the
step outputs (plain data: it crosses the thread seam)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at one position: the sampled token first, then the top-N, with ranks."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int
