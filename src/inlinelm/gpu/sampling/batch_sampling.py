"""The sampling side of the persistent batch (as vLLM's ``gpu_input_batch``).

Three things are kept across steps instead of being rebuilt from every request each step:

- the rows' sampling settings, in the numpy columns of
  :class:`~inlinelm.gpu.input_batch.SamplingColumns` (written when a row is added), from which
  a step's :class:`~inlinelm.gpu.sampling.metadata.PendingSampling` is staged with vectorised
  numpy;
- the penalty tables, one ``[rows, V]`` seen table and one count table on the device
  (:class:`PenaltyTables`): a row's are reset from its known tokens when it is added, and each
  step's sampled tokens are recorded into them on the device, so a token sampled by a step
  still in flight is counted without the host knowing it;
- the metadata itself, reused while the sampling rows and their requests stay the same
  (:class:`BatchSampling`); only the penalty tables are gathered anew each step.

The metadata equals :meth:`SamplingMetadata.build` over the same requests and tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from inlinelm.gpu.attention.metadata import IntArray
from inlinelm.gpu.input_batch import SamplingColumns
from inlinelm.gpu.sampling.metadata import (
    PendingSampling,
    SamplingMetadata,
    TableSource,
    stage_logit_bias,
)
from inlinelm.gpu.staging import HostStaging, StagedColumn
from inlinelm.sampling_params import SamplingParams


@dataclass(slots=True)
class _Reset:
    seen: list[int] | None  # prompt and output tokens, when the row uses repetition
    counted: list[int] | None  # output tokens, when it uses presence or frequency


class PenaltyTables:
    """Per-row seen (bool) and count (float32) tables ``[max_rows, V]`` on the device.

    Each is allocated when the first row that needs it is added. Rows that use no penalty
    are not kept up to date: the metadata masks them out.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.shape = (max_rows, vocab_size)
        self.device = device
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self._resets: dict[int, _Reset] = {}

    def queue_reset(self, row: int, seen: list[int] | None, counted: list[int] | None) -> None:
        """Have ``row`` hold these tokens from the next staged step on (a later reset of the
        same row replaces this one)."""
        if seen is not None and self.seen is None:
            self.seen = torch.zeros(self.shape, dtype=torch.bool, device=self.device)
        if counted is not None and self.counts is None:
            self.counts = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        self._resets[row] = _Reset(seen, counted)

    def stage_resets(self, staging: HostStaging) -> Callable[[], None] | None:
        """Stage the queued resets; the result applies them once the staging was sent."""
        if not self._resets:
            return None
        resets, self._resets = self._resets, {}
        steps = [
            _stage_reset(table, {r: getattr(x, name) for r, x in resets.items()}, staging)
            for table, name in ((self.seen, "seen"), (self.counts, "counted"))
            if table is not None
        ]

        def apply() -> None:
            for step in steps:
                if step is not None:
                    step()

        return apply

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count ``token_ids[j]`` as the next output token of row ``rows[j]`` (device work)."""
        if self.seen is not None:
            self.seen[rows, token_ids] = True
        if self.counts is not None:
            ones = torch.ones_like(token_ids, dtype=torch.float32)
            self.counts.index_put_((rows, token_ids), ones, accumulate=True)


def _stage_reset(
    table: torch.Tensor, tokens: dict[int, list[int] | None], staging: HostStaging
) -> Callable[[], None] | None:
    used = {row: ids for row, ids in tokens.items() if ids is not None}
    if not used:
        return None
    lengths = [len(ids) for ids in used.values()]
    rows = staging.add(list(used), np.int64)
    flat_rows = staging.add(np.repeat(np.fromiter(used, np.int64), lengths), np.int64)
    flat_ids = staging.add([t for ids in used.values() for t in ids], np.int64)

    def apply() -> None:
        table[rows.get()] = 0
        index = (flat_rows.get(), flat_ids.get())
        if table.dtype == torch.bool:
            table[index] = True
        else:
            ones = torch.ones_like(index[1], dtype=torch.float32)
            table.index_put_(index, ones, accumulate=True)

    return apply


class BatchSampling:
    """Stages each step's sampling metadata from the persistent batch, reusing the last
    step's while its sampling rows and their requests are the same."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.tables = PenaltyTables(max_rows, vocab_size, device)
        self._key: tuple[int, ...] | None = None
        self._held: list[object] = []  # keeps the key's ids from being reused
        self._pending: PendingSampling | None = None
        self._meta: SamplingMetadata | None = None

    def add_row(
        self, row: int, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
    ) -> None:
        """A request now holds ``row``: its penalty tables start from its known tokens."""
        repetition = params.repetition_penalty != 1.0
        occurrence = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        if repetition or occurrence:
            self.tables.queue_reset(
                row,
                [*prompt, *output] if repetition else None,
                list(output) if occurrence else None,
            )

    def stage(
        self,
        requests: Sequence[object],
        rows: IntArray,
        columns: SamplingColumns,
        generators: Sequence[torch.Generator | None],
        staging: HostStaging,
    ) -> Callable[[], SamplingMetadata]:
        """Stage a step sampling ``rows`` (held by ``requests``, in the step's order); the
        result gives its metadata once the staging was sent."""
        resets = self.tables.stage_resets(staging)
        # NOTE: a request re-added after preemption gets a new generator (and its tables a
        # reset), so generators are part of the key.
        key = (*map(id, requests), *map(id, generators), *rows.tolist())
        if key == self._key and self._pending is not None and self._meta is not None:
            pending, meta = self._pending, self._meta
        else:
            pending = stage_columns(
                rows, columns, generators, self.tables, self.vocab_size, staging
            )
            held = [*requests, *generators]
            self._key, self._held, self._pending, self._meta = key, held, pending, None
            meta = None

        def finish() -> SamplingMetadata:
            if resets is not None:
                resets()
            if meta is not None:
                return pending.refresh(meta)
            self._meta = pending.finish()
            return self._meta

        return finish


def stage_columns(
    rows: IntArray,
    columns: SamplingColumns,
    generators: Sequence[torch.Generator | None],
    tables: PenaltyTables,
    vocab_size: int,
    staging: HostStaging,
) -> PendingSampling:
    """:meth:`SamplingMetadata.stage` for batch ``rows``, from the persistent columns and
    tables (the same metadata, vectorised)."""
    greedy = columns.greedy[rows]
    params: list[SamplingParams] = [columns.params[int(r)] for r in rows]  # type: ignore[misc]
    all_greedy, any_greedy = bool(greedy.all()), bool(greedy.any())
    top_k = columns.top_k[rows]
    on = (top_k > 0) & (top_k < vocab_size) & ~greedy
    num_logprobs = [p.logprobs for p in params]
    wanted = [n for n in num_logprobs if n is not None]
    seeded = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
    device_rows = staging.add(rows, np.int64)
    return PendingSampling(
        num_rows=len(rows),
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=not any_greedy,
        greedy_mask=None if all_greedy or not any_greedy else staging.add(greedy, np.bool_),
        temperature=_column(columns.temperature[rows], greedy, 1.0, np.float32, staging),
        top_k=_column(
            np.where(top_k > 0, np.minimum(top_k, vocab_size), vocab_size),
            greedy,
            vocab_size,
            np.int64,
            staging,
        ),
        max_top_k=int(top_k[on].max()) if on.any() else 0,
        top_p=_column(columns.top_p[rows], greedy, 1.0, np.float32, staging),
        min_p=_column(columns.min_p[rows], greedy, 0.0, np.float32, staging),
        generators=seeded,
        seeded_rows=staging.add(sorted(seeded), np.int64) if seeded else None,
        repetition=_stage_repetition(rows, columns, tables, device_rows, staging),
        occurrence=_stage_occurrence(rows, columns, tables, device_rows, staging),
        logit_bias=stage_logit_bias(params, staging),
        num_logprobs=num_logprobs,
        max_num_logprobs=max(wanted) if wanted else None,
    )


def _column(
    values: npt.NDArray[np.generic],
    greedy: npt.NDArray[np.bool_],
    neutral: float,
    dtype: type[np.generic],
    staging: HostStaging,
) -> StagedColumn | None:
    """``values`` with greedy rows neutral; None when every row is neutral."""
    values = np.where(greedy, neutral, values)
    if bool((values == neutral).all()):
        return None
    return staging.add(values, dtype)


def _stage_repetition(
    rows: IntArray,
    columns: SamplingColumns,
    tables: PenaltyTables,
    device_rows: StagedColumn,
    staging: HostStaging,
) -> tuple[StagedColumn, TableSource] | None:
    used = columns.uses_repetition[rows]
    if not used.any():
        return None
    assert tables.seen is not None
    penalty = staging.add(np.where(used, columns.repetition_penalty[rows], 1.0), np.float32)
    return penalty, _gather(tables.seen, device_rows, used, staging)


def _stage_occurrence(
    rows: IntArray,
    columns: SamplingColumns,
    tables: PenaltyTables,
    device_rows: StagedColumn,
    staging: HostStaging,
) -> tuple[StagedColumn, StagedColumn, TableSource] | None:
    used = columns.uses_occurrence[rows]
    if not used.any():
        return None
    assert tables.counts is not None
    presence = np.where(used, columns.presence_penalty[rows], 0.0)
    frequency = np.where(used, columns.frequency_penalty[rows], 0.0)
    return (
        staging.add(presence, np.float32),
        staging.add(frequency, np.float32),
        _gather(tables.counts, device_rows, used, staging),
    )


def _gather(
    table: torch.Tensor, rows: StagedColumn, used: npt.NDArray[np.bool_], staging: HostStaging
) -> TableSource:
    """The step's ``[B, V]`` slice of ``table``, rows with the penalty off zeroed."""
    mask = None if bool(used.all()) else staging.add(used, np.bool_)

    def source() -> torch.Tensor:
        part = table.index_select(0, rows.get())
        if mask is not None:
            part.mul_(mask.get().unsqueeze(1))
        return part

    return source
