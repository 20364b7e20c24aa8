"""One step's sampling settings as device tensors, one row per sequence in the batch.

:meth:`SamplingMetadata.stage` turns the per-request :class:`~inlinelm.sampling_params.SamplingParams`
into host columns of the step's :class:`~inlinelm.gpu.staging.HostStaging` (no copy of its
own: the step sends everything at once), and :meth:`PendingSampling.finish` into the tensors
:class:`~inlinelm.gpu.sampling.sampler.Sampler` needs once they are on the device. Every tensor no row
uses is left out (``None``), so a batch without penalties never allocates a ``[B, V]`` count
table and an all-greedy batch reduces to one ``argmax``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from inlinelm.gpu.staging import HostStaging, StagedColumn
from inlinelm.sampling_params import SamplingParams


@dataclass(slots=True)
class RepetitionPenalty:
    """HF-style repetition penalty over prompt and output tokens.

    ``penalty`` is ``[B]`` float32 (1.0 where off); ``seen`` is ``[B, V]`` bool, true for every
    token in the row's prompt or output (left all false for rows with the penalty off).
    """

    penalty: torch.Tensor
    seen: torch.Tensor


@dataclass(slots=True)
class OccurrencePenalty:
    """OpenAI-style presence and frequency penalties over output tokens.

    ``presence`` and ``frequency`` are ``[B]`` float32 (0.0 where off); ``counts`` is ``[B, V]``
    float32, how often each token occurs in the row's output so far.
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    counts: torch.Tensor


@dataclass(slots=True)
class LogitBias:
    """Sparse additive bias: ``logits[rows[j], token_ids[j]] += values[j]`` (all ``[K]``)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    values: torch.Tensor


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling settings for a batch of ``num_rows`` sequences, as tensors on one device.

    Every optional tensor is ``None`` when no row needs it. Greedy rows (``temperature == 0``
    or ``top_k == 1``) carry neutral values in the random-sampling tensors (temperature 1.0,
    top-k off, top-p 1.0, min-p 0.0) and no generator.
    """

    num_rows: int
    vocab_size: int
    # True when every row is greedy / no row is greedy (both true only for an empty batch).
    all_greedy: bool
    all_random: bool
    # [B] bool, true for greedy rows; None when all_greedy or all_random.
    greedy_mask: torch.Tensor | None
    # [B] float32, 1.0 for greedy rows; None when every random row has temperature 1.0.
    temperature: torch.Tensor | None
    # [B] int64 in [1, V], V meaning off; None when no random row uses top-k.
    top_k: torch.Tensor | None
    # The largest top-k that is on (< V); 0 when top_k is None.
    max_top_k: int
    # [B] float32 in (0, 1]; None when no random row uses top-p.
    top_p: torch.Tensor | None
    # [B] float32 in [0, 1]; None when no random row uses min-p.
    min_p: torch.Tensor | None
    # Row index -> the request's own generator, for seeded random rows only.
    generators: dict[int, torch.Generator]
    # [S] int64, the keys of ``generators`` in order; None when there are none.
    seeded_rows: torch.Tensor | None
    repetition: RepetitionPenalty | None
    occurrence: OccurrencePenalty | None
    logit_bias: LogitBias | None
    # Per row: how many top logprobs it wants (0 = only the sampled token's), None = none.
    num_logprobs: list[int | None]
    # max(num_logprobs) over rows that want logprobs; None when no row does.
    max_num_logprobs: int | None

    @property
    def no_penalties(self) -> bool:
        """True when no row uses a repetition, presence or frequency penalty."""
        return self.repetition is None and self.occurrence is None

    @property
    def no_logit_bias(self) -> bool:
        """True when no row has a logit bias."""
        return self.logit_bias is None

    @property
    def plain_greedy(self) -> bool:
        """True when sampling is a bare ``argmax`` of the raw logits (the fast path)."""
        return (
            self.all_greedy
            and self.no_penalties
            and self.no_logit_bias
            and self.max_num_logprobs is None
        )

    def count_tokens(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one more output token ``token_ids[j]`` in row ``rows[j]`` for the penalties.

        For tokens only the device knows (sampled by a step still in flight); no host sync.
        Rows with a penalty off are unaffected (their penalty is neutral).
        """
        if self.repetition is not None:
            self.repetition.seen[rows, token_ids] = True
        if self.occurrence is not None:
            ones = torch.ones_like(token_ids, dtype=torch.float32)
            self.occurrence.counts.index_put_((rows, token_ids), ones, accumulate=True)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """:meth:`stage` and :meth:`PendingSampling.finish` with a copy of its own (for
        callers outside the step path: profiling, tests)."""
        staging = HostStaging(device)
        pending = cls.stage(
            params, prompt_token_ids, output_token_ids, generators, vocab_size, staging
        )
        staging.send()
        return pending.finish()

    @staticmethod
    def stage(
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        staging: HostStaging,
    ) -> PendingSampling:
        """Stage the metadata of one step; all sequences are indexed by batch row.

        ``generators[i]`` is row ``i``'s own generator (on the device) when its request has
        a seed, else ``None``; it is only drawn from while the row samples randomly. Token
        ids lie in ``[0, vocab_size)``: admission checked them
        (``Admission.check_token_ids``).
        """
        assert len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators)
        greedy = [p.greedy for p in params]
        builder = _Columns(params, greedy, staging)
        num_logprobs = [p.logprobs for p in params]
        wanted = [n for n in num_logprobs if n is not None]
        top_k, max_top_k = builder.top_k(vocab_size)
        seeded = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
        return PendingSampling(
            num_rows=len(params),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            greedy_mask=None if all(greedy) or not any(greedy) else staging.add(greedy, np.bool_),
            temperature=builder.column(lambda p: p.temperature, 1.0),
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=builder.column(lambda p: p.top_p, 1.0),
            min_p=builder.column(lambda p: p.min_p, 0.0),
            generators=seeded,
            seeded_rows=staging.add(sorted(seeded), np.int64) if seeded else None,
            repetition=_stage_repetition(
                params, prompt_token_ids, output_token_ids, vocab_size, staging
            ),
            occurrence=_stage_occurrence(params, output_token_ids, vocab_size, staging),
            logit_bias=stage_logit_bias(params, staging),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
        )


@dataclass(slots=True)
class PendingSampling:
    """A step's :class:`SamplingMetadata` whose columns are staged, not yet on the device."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: StagedColumn | None
    temperature: StagedColumn | None
    top_k: StagedColumn | None
    max_top_k: int
    top_p: StagedColumn | None
    min_p: StagedColumn | None
    generators: dict[int, torch.Generator]
    seeded_rows: StagedColumn | None
    # (penalty [B], what makes the [B, V] seen table on the device)
    repetition: tuple[StagedColumn, TableSource] | None
    # (presence [B], frequency [B], what makes the [B, V] count table on the device)
    occurrence: tuple[StagedColumn, StagedColumn, TableSource] | None
    logit_bias: tuple[StagedColumn, StagedColumn, StagedColumn] | None
    num_logprobs: list[int | None]
    max_num_logprobs: int | None

    def finish(self) -> SamplingMetadata:
        """The metadata on the device, once the staging was sent (device work only)."""
        return SamplingMetadata(
            num_rows=self.num_rows,
            vocab_size=self.vocab_size,
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            greedy_mask=_get(self.greedy_mask),
            temperature=_get(self.temperature),
            top_k=_get(self.top_k),
            max_top_k=self.max_top_k,
            top_p=_get(self.top_p),
            min_p=_get(self.min_p),
            generators=self.generators,
            seeded_rows=_get(self.seeded_rows),
            repetition=self._repetition(),
            occurrence=self._occurrence(),
            logit_bias=None
            if self.logit_bias is None
            else LogitBias(*(c.get() for c in self.logit_bias)),
            num_logprobs=self.num_logprobs,
            max_num_logprobs=self.max_num_logprobs,
        )

    def refresh(self, meta: SamplingMetadata) -> SamplingMetadata:
        """``meta`` (this step's, finished before) with its penalty tables made anew: the
        metadata of a later step with the same rows (device work only)."""
        if meta.no_penalties:
            return meta
        return replace(meta, repetition=self._repetition(), occurrence=self._occurrence())

    def _repetition(self) -> RepetitionPenalty | None:
        if self.repetition is None:
            return None
        penalty, table = self.repetition
        return RepetitionPenalty(penalty.get(), table())

    def _occurrence(self) -> OccurrencePenalty | None:
        if self.occurrence is None:
            return None
        presence, frequency, table = self.occurrence
        return OccurrencePenalty(presence=presence.get(), frequency=frequency.get(), counts=table())


TableSource = Callable[[], torch.Tensor]
"""Makes a ``[B, V]`` penalty table on the device, once the staging was sent."""


def _get(column: StagedColumn | None) -> torch.Tensor | None:
    return None if column is None else column.get()


class _Columns:
    """Stages ``[B]`` columns of random-sampling settings, neutral for greedy rows."""

    def __init__(
        self, params: Sequence[SamplingParams], greedy: list[bool], staging: HostStaging
    ) -> None:
        self.params = params
        self.greedy = greedy
        self.staging = staging

    def column(
        self,
        value: Callable[[SamplingParams], float | int],
        neutral: float | int,
        dtype: type[np.generic] = np.float32,
    ) -> StagedColumn | None:
        """The column of ``value(p)``, or ``None`` when every random row has the neutral value."""
        values = [neutral if g else value(p) for p, g in zip(self.params, self.greedy, strict=True)]
        if all(v == neutral for v in values):
            return None
        return self.staging.add(values, dtype)

    def top_k(self, vocab_size: int) -> tuple[StagedColumn | None, int]:
        """The top-k column (``vocab_size`` meaning off) and the largest k that is on."""
        column = self.column(
            lambda p: min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size,
            vocab_size,
            np.int64,
        )
        ks = [p.top_k for p, g in zip(self.params, self.greedy, strict=True) if not g]
        return column, max((k for k in ks if 0 < k < vocab_size), default=0)


def _stage_repetition(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    staging: HostStaging,
) -> tuple[StagedColumn, TableSource] | None:
    used = [p.repetition_penalty != 1.0 for p in params]
    if not any(used):
        return None
    tokens = [
        itertools.chain(prompt, output) if u else ()
        for u, prompt, output in zip(used, prompt_token_ids, output_token_ids, strict=True)
    ]
    rows, ids = _flat_index(tokens, staging)
    shape = (len(params), vocab_size)
    return (
        staging.add([p.repetition_penalty for p in params], np.float32),
        lambda: _table(shape, rows.get(), ids.get(), torch.bool),
    )


def _stage_occurrence(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    staging: HostStaging,
) -> tuple[StagedColumn, StagedColumn, TableSource] | None:
    used = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
    if not any(used):
        return None
    rows, ids = _flat_index(
        [out if u else () for u, out in zip(used, output_token_ids, strict=True)], staging
    )
    shape = (len(params), vocab_size)
    return (
        staging.add([p.presence_penalty for p in params], np.float32),
        staging.add([p.frequency_penalty for p in params], np.float32),
        lambda: _table(shape, rows.get(), ids.get(), torch.float32),
    )


def _table(
    shape: tuple[int, int], rows: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A ``[B, V]`` table of zeros with ``table[rows[j], ids[j]]`` set (bool) or counted."""
    table = torch.zeros(shape, dtype=dtype, device=rows.device)
    if dtype == torch.bool:
        table[rows, ids] = True
    else:
        # NOTE: accumulating 1.0s is exact (counts < 2**24), so atomic ordering cannot change it.
        table.index_put_((rows, ids), torch.ones_like(ids, dtype=dtype), accumulate=True)
    return table


def stage_logit_bias(
    params: Sequence[SamplingParams], staging: HostStaging
) -> tuple[StagedColumn, StagedColumn, StagedColumn] | None:
    """(rows, token ids, values) of every row's logit bias, or None when no row has one."""
    entries = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias.items()]
    if not entries:
        return None
    rows, ids, values = zip(*entries, strict=True)
    return (
        staging.add(rows, np.int64),
        staging.add(ids, np.int64),
        staging.add(values, np.float32),
    )


def _flat_index(
    token_lists: Sequence[Sequence[int] | itertools.chain[int]], staging: HostStaging
) -> tuple[StagedColumn, StagedColumn]:
    """(row, token id) pairs for every token of every row, as two staged ``[N]`` int64 columns."""
    lists = [list(tokens) for tokens in token_lists]
    lengths = np.array([len(t) for t in lists], dtype=np.int64)
    ids = np.fromiter(
        itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum())
    )
    rows = np.repeat(np.arange(len(lists), dtype=np.int64), lengths)
    return staging.add(rows, np.int64), staging.add(ids, np.int64)
