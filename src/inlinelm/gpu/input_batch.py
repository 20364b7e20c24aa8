"""The persistent input batch: one row per live request, kept across steps.

Rows are added when a request is first scheduled and removed when the scheduler says it
finished, was aborted or was preempted; everything else is kept, so a decode step only
appends one token and maybe one block id per row. Step inputs are built from these arrays
with vectorised numpy, never a Python loop per token. Each row's sampling settings are
written once, when it is added, into the numpy columns of :class:`SamplingColumns`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from inlinelm.gpu.attention.metadata import IntArray
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request

BoolArray = npt.NDArray[np.bool_]


@dataclass(slots=True)
class StepInputs:
    """Flat inputs of one forward pass, as numpy arrays (the runner moves them to the device)."""

    input_ids: IntArray
    positions: IntArray  # each token's row of the RoPE table (its position, but see prepare)
    slot_mapping: IntArray
    query_start_loc: IntArray
    seq_lens: IntArray
    block_tables: IntArray
    logits_indices: IntArray
    sampling_rows: IntArray  # batch rows (rows of the persistent arrays) that sample
    sampling_positions: IntArray  # index into the scheduled list of each sampling request
    max_query_len: int
    max_seq_len: int
    # Tokens sampled by a step still in flight: ``input_ids[pending_tokens]`` is not known on
    # the host and is gathered on the device from the last token sampled in ``pending_rows``.
    pending_tokens: IntArray
    pending_rows: IntArray


class SamplingColumns:
    """Per-row sampling settings as numpy columns (vLLM's persistent batch), one row per slot.

    ``top_k`` is the request's own value (0 = off); a row's values are those of the request
    that holds it, written by :meth:`write` when the row is added.
    """

    def __init__(self, max_num_reqs: int) -> None:
        n = max_num_reqs
        self.greedy = np.zeros(n, dtype=np.bool_)
        self.temperature = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        # Whether the row uses each penalty (decided on the request's float values).
        self.uses_repetition = np.zeros(n, dtype=np.bool_)
        self.uses_occurrence = np.zeros(n, dtype=np.bool_)
        self.params: list[SamplingParams | None] = [None] * n

    def write(self, row: int, params: SamplingParams) -> None:
        """Hold ``params`` in ``row``."""
        self.greedy[row] = params.greedy
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.min_tokens[row] = params.min_tokens
        self.uses_repetition[row] = params.repetition_penalty != 1.0
        self.uses_occurrence[row] = (
            params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        self.params[row] = params


class InputBatch:
    """Token ids and block tables of every live request, in preallocated arrays."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        long_context_from: int | None = None,
    ) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.long_context_from = long_context_from
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: list[Request | None] = [None] * max_num_reqs
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        # Whether the row's request has a grammar (fixed before it is first scheduled).
        self.has_grammar = np.zeros(max_num_reqs, dtype=np.bool_)
        self.sampling = SamplingColumns(max_num_reqs)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, request: Request, generator: torch.Generator | None) -> int:
        """Give ``request`` a row holding all its known tokens; return the row."""
        row = self._free_rows.pop()
        tokens = request.all_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_blocks[row] = 0
        self.requests[row] = request
        self.generators[row] = generator
        # NOTE: a grammar behind a reasoning gate counts: each step reads request.grammar
        self.has_grammar[row] = request.grammar is not None or request.grammar_gate is not None
        self.sampling.write(row, request.params)
        self.row_of[request.request_id] = row
        return row

    def remove(self, request_id: str) -> None:
        """Forget a request (idempotent)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.requests[row] = None
            self.generators[row] = None
            self._free_rows.append(row)

    def sync_blocks(self, rows: IntArray, block_ids: list[list[int]]) -> None:
        """Append the block ids each of ``rows`` gained since the last step (``block_ids``:
        each row's request's whole list)."""
        counts = np.array([len(ids) for ids in block_ids], dtype=np.int64)
        for i in np.flatnonzero(counts > self.num_blocks[rows]).tolist():
            row, have = int(rows[i]), int(self.num_blocks[rows[i]])
            self.block_table[row, have : counts[i]] = block_ids[i][have:]
            self.num_blocks[row] = counts[i]

    def append_tokens(self, rows: IntArray, token_ids: IntArray) -> None:
        """Append one sampled token to each of ``rows`` (once the host knows it)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def prepare(
        self, rows: IntArray, num_scheduled: IntArray, num_computed: IntArray, samples: BoolArray
    ) -> StepInputs:
        """Build the flat step inputs for ``rows`` computing ``num_scheduled`` tokens each.

        ``num_computed`` counts the tokens before this step's (steps in flight included);
        ``samples`` says which rows sample. A token at or past a row's ``num_tokens`` was
        sampled by a step in flight: it goes into ``pending_tokens``. With
        ``long_context_from`` (longrope), a sequence longer than that reads its first
        positions' RoPE rows after the ``max_model_len`` ones (see
        :mod:`inlinelm.gpu.model.rope`).
        """
        total = int(num_scheduled.sum())
        if total == len(rows):  # a decode step: one token per row, nothing to repeat
            query_start_loc = np.arange(total + 1, dtype=np.int64)
            row_of_token, positions = rows, num_computed
        else:
            query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            row_of_token = np.repeat(rows, num_scheduled)
            starts = np.repeat(query_start_loc[:-1], num_scheduled)
            positions = np.repeat(num_computed, num_scheduled) + np.arange(total) - starts
        block_ids = self.block_table[row_of_token, positions // self.block_size]
        seq_lens = num_computed + num_scheduled
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        sampling_positions = np.flatnonzero(samples)
        known = positions < self.num_tokens[row_of_token]
        pending_tokens = np.flatnonzero(~known)
        rope_rows = positions
        if self.long_context_from is not None:
            # NOTE: a sequence's length is its known tokens, or its last position + 1 when a
            # step in flight holds its last token (the scheduler's count, the same number).
            lengths = np.maximum(self.num_tokens[row_of_token], positions + 1)
            if total != len(rows):
                lengths = np.maximum(lengths, np.repeat(seq_lens, num_scheduled))
            long = (lengths > self.long_context_from) & (positions < self.long_context_from)
            rope_rows = np.where(long, positions + self.max_model_len, positions)
        return StepInputs(
            input_ids=np.where(known, self.token_ids[row_of_token, positions], 0),
            positions=rope_rows,
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max_blocks],
            logits_indices=query_start_loc[1:][samples] - 1,
            sampling_rows=rows[samples],
            sampling_positions=sampling_positions,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
            pending_tokens=pending_tokens,
            pending_rows=row_of_token[pending_tokens],
        )
