"""One step's forward, staged with the step's inputs (engine thread).

:func:`stage_forward` runs on the host before the step's one copy: it stages the model's
inputs, for a replay of the decode graphs when they can take the step
(:meth:`~inlinelm.gpu.cuda_graphs.DecodeGraphs.can_replay`), else for an eager forward over
:class:`~inlinelm.gpu.attention.metadata.AttentionMetadata` built from the staged
columns. What it returns runs the forward once the staging is sent. Input tokens sampled
by steps still in flight are filled in on the device, from the last token sampled in
their rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.cuda_graphs import DecodeGraphs, FillPending
from inlinelm.gpu.input_batch import StepInputs
from inlinelm.gpu.staging import HostStaging, send_one

Forward = Callable[[], torch.Tensor]
"""Runs a staged step's forward once its staging is sent: logits ``[num sampling rows, V]``."""

RunModel = Callable[[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``run(meta, input_ids, positions, logits_indices)``: the runner's model over its KV cache
(the backend plans ``meta`` first); logits of the ``logits_indices`` tokens."""


def stage_forward(
    inputs: StepInputs,
    staging: HostStaging,
    graphs: DecodeGraphs | None,
    last_sampled: torch.Tensor,
    run_model: RunModel,
) -> Forward:
    """Stage a step's model inputs: a graph replay when ``graphs`` can take it, else an eager
    forward through ``run_model``. ``last_sampled`` is the last token sampled in each batch
    row (on the device), where tokens of steps in flight are read."""
    fill = _stage_pending(inputs, staging, last_sampled)
    if graphs is not None and graphs.can_replay(inputs):
        step = graphs.stage(inputs, staging)
        if len(inputs.sampling_rows) == len(inputs.seq_lens):
            return lambda: graphs.run(step, fill)
        positions = staging.add(inputs.sampling_positions, np.int64)
        return lambda: graphs.run(step, fill)[positions.get()]
    return _stage_eager(inputs, staging, fill, run_model)


def one_sequence_metadata(
    start: int, n: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Positions ``start..n-1`` of one sequence whose cache is the first blocks of a cache:
    the metadata of the warm-up and profiling forwards."""
    new = n - start
    return AttentionMetadata(
        slot_mapping=torch.arange(start, n, device=device),
        query_start_loc=send_one([0, new], np.int64, device),
        seq_lens=send_one([n], np.int64, device),
        block_tables=torch.arange(-(-n // block_size), device=device)[None],
        max_query_len=new,
        max_seq_len=n,
    )


def _stage_eager(
    inputs: StepInputs, staging: HostStaging, fill: FillPending | None, run_model: RunModel
) -> Forward:
    add = staging.add
    slots, starts = add(inputs.slot_mapping, np.int64), add(inputs.query_start_loc, np.int64)
    seq_lens, tables = add(inputs.seq_lens, np.int64), add(inputs.block_tables, np.int64)
    ids, positions = add(inputs.input_ids, np.int64), add(inputs.positions, np.int64)
    logits_indices = add(inputs.logits_indices, np.int64)

    def forward() -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=slots.get(),
            query_start_loc=starts.get(),
            seq_lens=seq_lens.get(),
            block_tables=tables.get(),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            host_query_start_loc=inputs.query_start_loc,
            host_seq_lens=inputs.seq_lens,
            host_block_tables=inputs.block_tables,
        )
        input_ids = ids.get()
        if fill is not None:
            fill(input_ids)
        return run_model(meta, input_ids, positions.get(), logits_indices.get())

    return forward


def _stage_pending(
    inputs: StepInputs, staging: HostStaging, last_sampled: torch.Tensor
) -> FillPending | None:
    """What writes the tokens sampled by steps in flight into ``input_ids`` (on the
    device), or None when the host knows every input token."""
    if not len(inputs.pending_tokens):
        return None
    rows = staging.add(inputs.pending_rows, np.int64)
    tokens = staging.add(inputs.pending_tokens, np.int64)

    def fill(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, tokens.get(), last_sampled.index_select(0, rows.get()))

    return fill
