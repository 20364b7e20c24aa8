"""The batched sampler: one token per row from ``[B, V]`` logits, on the engine thread.

Pipeline (each step skipped when no row needs it)::

    logit_bias -> repetition penalty -> presence/frequency penalties
      -> greedy rows: argmax
      -> temperature -> (logprobs) -> top-k -> top-p -> min-p -> sample

Random rows sample with the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per
token picks token ``i`` with probability ``probs[i]``. A seeded row draws its ``q`` from its own
generator, so a seed gives the same tokens whatever else is in the batch and at any row.

On CUDA, rows without a seed can sample through FlashInfer's top-k/top-p kernels instead
(:class:`FlashInferSampling`, any :class:`RandomKernel`): same distribution, other random
stream. Seeded rows always take the torch path (a per-request ``torch.Generator`` cannot
feed a batched kernel), and so does a batch with min-p (the torch order, top-k, top-p then
min-p, is kept). No step of either path syncs with the host.

Logprobs are "processed" logprobs (vLLM's ``processed_logprobs`` mode): ``log_softmax`` of the
logits after logit bias, penalties and temperature (1.0 for greedy rows), but *before* top-k,
top-p and min-p truncation, so every token has a finite logprob and ranks are over the whole
vocabulary.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from inlinelm.gpu.sampling.metadata import (
    LogitBias,
    OccurrencePenalty,
    RepetitionPenalty,
    SamplingMetadata,
)
from inlinelm.sched.output import TokenLogprobs


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs for a batch: the sampled token's (``[B]``) and the top-N (``[B, N]``)."""

    sampled_logprobs: torch.Tensor
    # 1-based rank of the sampled token: 1 + how many tokens have a strictly higher logprob.
    sampled_ranks: torch.Tensor
    # Sorted by logprob, highest first.
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass(slots=True)
class SamplerOutput:
    """``sampled`` is ``[B]`` int64; ``logprobs`` is set when some row asked for logprobs."""

    sampled: torch.Tensor
    logprobs: LogprobsTensors | None = None


class RandomKernel(Protocol):
    """Samples one token per row of ``probs`` [B, V] within its top-k (``[B]``, V = off)
    and top-p (``[B]``) nucleus; either may be None (off for every row)."""

    def __call__(
        self, probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        """Return ``[B]`` token ids (any integer dtype)."""
        ...


class FlashInferSampling:
    """:class:`RandomKernel` on ``flashinfer.sampling`` (CUDA; the torch generator's state)."""

    def __init__(self) -> None:
        self._kernels: Any = importlib.import_module("flashinfer.sampling")

    def __call__(
        self, probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        """See :class:`RandomKernel`."""
        k = self._kernels
        if top_k is None and top_p is None:
            result: torch.Tensor = k.sampling_from_probs(probs)
        elif top_p is None:
            result = k.top_k_sampling_from_probs(probs, top_k.int())  # type: ignore[union-attr]
        elif top_k is None:
            result = k.top_p_sampling_from_probs(probs, top_p)
        else:
            result = k.top_k_top_p_sampling_from_probs(
                probs, top_k.int(), top_p, filter_apply_order="top_k_first"
            )
        return result


def flashinfer_sampling(device: torch.device) -> RandomKernel | None:
    """FlashInfer's kernels on a CUDA ``device`` when ``flashinfer`` imports, else None."""
    if device.type != "cuda":
        return None
    try:
        return FlashInferSampling()
    except Exception:  # a broken install falls back to torch, as attention does
        return None


class Sampler:
    """Samples one token per row; stateless, one instance serves every step.

    ``kernel``, when given, samples the unseeded random rows (see the module docstring).
    """

    def __init__(self, kernel: RandomKernel | None = None) -> None:
        self.kernel = kernel

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` (``[B, V]`` float32) under ``meta``.

        NOTE: ``logits`` is consumed: it may be modified in place.
        """
        assert logits.dtype == torch.float32, logits.dtype
        assert logits.shape == (meta.num_rows, meta.vocab_size), logits.shape
        if meta.plain_greedy:
            return SamplerOutput(sampled=logits.argmax(dim=-1))
        # 1) Adjust the logits every row sees: bias, then penalties.
        if meta.logit_bias is not None:
            apply_logit_bias(logits, meta.logit_bias)
        if meta.repetition is not None:
            apply_repetition_penalty(logits, meta.repetition)
        if meta.occurrence is not None:
            apply_occurrence_penalty(logits, meta.occurrence)
        # 2) Greedy rows pick before temperature (argmax is unchanged by it anyway).
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        # 3) Temperature; greedy rows carry 1.0, so their logprobs use the unscaled logits.
        if meta.temperature is not None:
            logits.div_(meta.temperature.unsqueeze(1))
        logprobs = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        # 4) Random rows: truncate, then sample.
        random = None if meta.all_greedy else _sample_random(logits, meta, self.kernel)
        sampled = _merge(greedy, random, meta)
        if logprobs is None or meta.max_num_logprobs is None:
            return SamplerOutput(sampled=sampled)
        return SamplerOutput(sampled, gather_logprobs(logprobs, sampled, meta.max_num_logprobs))


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """Add each row's logit bias to ``logits`` in place."""
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, rep: RepetitionPenalty) -> None:
    """HF semantics, in place: for seen tokens, positive logits ``/ p``, negative ones ``* p``."""
    penalty = torch.where(rep.seen, rep.penalty.unsqueeze(1), 1.0)
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(scaled)


def apply_occurrence_penalty(logits: torch.Tensor, occ: OccurrencePenalty) -> None:
    """OpenAI semantics, in place: ``logit -= frequency * count + presence * (count > 0)``."""
    logits.sub_(occ.frequency.unsqueeze(1) * occ.counts)
    logits.sub_(occ.presence.unsqueeze(1) * (occ.counts > 0))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> None:
    """Set to ``-inf`` the logits outside each row's top-k, then outside its top-p nucleus.

    ``top_k`` is ``[B]`` int64 with ``V`` meaning off; ``max_top_k`` the largest k that is on.
    Ties at the k-th logit are all kept. Top-p keeps the smallest highest-probability set whose
    mass reaches ``p`` (always at least one token).
    """
    if top_p is None:
        if top_k is not None:
            _apply_top_k_only(logits, top_k, max_top_k)
        return
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ascending.gather(1, (ascending.shape[1] - top_k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False
    ascending.masked_fill_(outside, float("-inf"))
    logits.scatter_(1, order, ascending)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k without a full sort: one ``topk(max_top_k)`` gives every row's k-th logit."""
    vocab_size = logits.shape[1]
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_((top_k == vocab_size).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Set to ``-inf`` tokens with ``prob < min_p * max_prob``, in place.

    Done in logit space: ``prob_i >= min_p * prob_max`` iff ``logit_i >= logit_max + log(min_p)``
    (``min_p == 0`` gives ``-inf``: nothing masked), which needs no softmax.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The sampled tokens' logprobs and ranks, and the top ``num_logprobs`` of each row."""
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(sampled_logprobs.squeeze(1), ranks, top_ids, top_logprobs)


def to_token_logprobs(
    output: SamplerOutput, num_logprobs: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per-row :class:`TokenLogprobs` (sampled token first, then its top-``n``), on the host.

    ``num_logprobs`` is :attr:`SamplingMetadata.num_logprobs`: a row with ``None`` gets ``None``;
    a row asking ``n`` below the batch maximum gets its first ``n`` top entries.
    """
    if output.logprobs is None:
        assert all(n is None for n in num_logprobs)
        return [None] * len(num_logprobs)
    lp = output.logprobs
    sampled = output.sampled.tolist()
    sampled_lp = lp.sampled_logprobs.tolist()
    ranks = lp.sampled_ranks.tolist()
    top_ids = lp.top_token_ids.tolist()
    top_lp = lp.top_logprobs.tolist()
    return [
        None
        if n is None
        else TokenLogprobs(
            token_ids=[sampled[i], *top_ids[i][:n]],
            logprobs=[sampled_lp[i], *top_lp[i][:n]],
            sampled_rank=ranks[i],
        )
        for i, n in enumerate(num_logprobs)
    ]


def _sample_random(
    logits: torch.Tensor, meta: SamplingMetadata, kernel: RandomKernel | None
) -> torch.Tensor:
    """Sample every row (greedy rows too: the caller drops theirs): unseeded rows through
    ``kernel`` when it applies, the rest through :func:`_sample_torch`."""
    generators = meta.generators
    if kernel is None or meta.min_p is not None or len(generators) == meta.num_rows:
        return _sample_torch(logits, meta.top_k, meta.max_top_k, meta.top_p, meta.min_p, generators)
    sampled = kernel(logits.softmax(dim=-1), meta.top_k, meta.top_p).long()
    if not generators:
        return sampled
    rows = sorted(generators)
    index = meta.seeded_rows
    assert index is not None
    seeded = _sample_torch(
        logits[index],
        None if meta.top_k is None else meta.top_k[index],
        meta.max_top_k,
        None if meta.top_p is None else meta.top_p[index],
        None,
        {i: generators[row] for i, row in enumerate(rows)},
    )
    return sampled.index_copy_(0, index, seeded)


def _sample_torch(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Truncate with top-k / top-p / min-p, then sample each row by the exponential race."""
    apply_top_k_top_p(logits, top_k, max_top_k, top_p)
    if min_p is not None:
        apply_min_p(logits, min_p)
    probs = logits.softmax(dim=-1)
    return probs.div_(_exponential_noise(probs, generators)).argmax(dim=-1)


def _exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``Exp(1)`` noise shaped like ``probs``; seeded rows draw from their own generator."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # NOTE: a draw of exactly 0 would turn a masked token's 0 / 0 into NaN, which argmax picks.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _merge(
    greedy: torch.Tensor | None, random: torch.Tensor | None, meta: SamplingMetadata
) -> torch.Tensor:
    """Greedy rows' tokens from ``greedy``, the others from ``random``."""
    if random is None:
        assert greedy is not None
        return greedy
    if greedy is None or meta.greedy_mask is None:
        return random
    return torch.where(meta.greedy_mask, greedy, random)
