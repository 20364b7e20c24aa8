"""One step's sampling, staged with the step's inputs (engine thread).

:meth:`StepSampling.stage` runs on the host before the step's one copy: it picks the
requests that sample, stages their settings (:class:`BatchSampling`), the EOS and stop
tokens banned for rows short of ``min_tokens``, and the rows a grammar constrains. What it
returns samples the step's logits on the device once the staging is sent, records each
row's token where the next steps read it (their decode inputs, the penalty tables), and
starts the copy of the sampled ids to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from inlinelm.gpu.input_batch import InputBatch, StepInputs
from inlinelm.gpu.sampling.batch_sampling import BatchSampling
from inlinelm.gpu.sampling.grammar_mask import GrammarMasks
from inlinelm.gpu.sampling.sampler import Sampler
from inlinelm.gpu.staging import HostStaging, StagedColumn
from inlinelm.gpu.step_output import StepInFlight, start_host_copy
from inlinelm.sched.output import SchedulerOutput
from inlinelm.sched.request import Request

SampleLogits = Callable[[torch.Tensor], StepInFlight]
"""Samples a step's logits ``[num sampling rows, V]`` once its staging is sent."""


class StepSampling:
    """The sampling state the runner keeps across steps: the last token sampled in each
    batch row (on the device, read by the next steps' decodes), the rows' penalty tables
    and cached metadata, and the grammar masks' buffers."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.grammar_masks = GrammarMasks(max_num_seqs, device)
        self.batch_sampling = BatchSampling(max_num_seqs, vocab_size, device)

    def add_row(self, row: int, request: Request) -> None:
        """``request`` now holds batch row ``row``: its penalty tables start from its tokens."""
        self.batch_sampling.add_row(
            row, request.params, request.prompt_token_ids, request.output_token_ids
        )

    def stage(
        self,
        sampler: Sampler,
        batch: SchedulerOutput,
        inputs: StepInputs,
        rows: InputBatch,
        staging: HostStaging,
    ) -> SampleLogits:
        """Stage the sampling of a step (``rows`` is the persistent batch it was built
        from); the result samples its logits with ``sampler`` once sent."""
        scheduled = batch.scheduled
        positions = inputs.sampling_positions
        if len(positions) == len(scheduled):
            requests = [item.request for item in scheduled]
        else:
            requests = [scheduled[i].request for i in positions.tolist()]
        if not requests:
            empty = StepInFlight([], inputs.sampling_rows, torch.empty(0, dtype=torch.int64))
            return lambda logits: empty
        generators = rows.generators
        finish = self.batch_sampling.stage(
            requests,
            inputs.sampling_rows,
            rows.sampling,
            [generators[row] for row in inputs.sampling_rows.tolist()],
            staging,
        )
        # NOTE: the rows' columns pick the few requests to look at: this runs every step.
        sampling_rows = inputs.sampling_rows
        early = np.flatnonzero(rows.sampling.min_tokens[sampling_rows]).tolist()
        banned = stage_early_stops(requests, early, staging)
        constrained = np.flatnonzero(rows.has_grammar[sampling_rows]).tolist()
        grammars = [(i, g) for i in constrained if (g := requests[i].grammar) is not None]
        grammar_rows = None
        if grammars and len(grammars) != len(requests):
            grammar_rows = staging.add([i for i, _ in grammars], np.int64)
        staged_rows = staging.add(inputs.sampling_rows, np.int64)

        def sample(logits: torch.Tensor) -> StepInFlight:
            # NOTE: the penalty tables already hold the tokens of steps in flight: each step
            # records its samples into them on the device.
            meta = finish()
            if banned is not None:
                logits.index_put_(
                    (banned[0].get(), banned[1].get()), logits.new_full((), float("-inf"))
                )
            if grammars:
                # NOTE: the scheduler never samples a constrained row while an earlier sample
                # of it is in flight, so its matcher has consumed every token before this one.
                index = None if grammar_rows is None else grammar_rows.get()
                self.grammar_masks.apply(logits, [m for _, m in grammars], index)
            out = sampler(logits, meta)
            sampled = out.sampled.long()
            self.last_sampled.index_copy_(0, staged_rows.get(), sampled)
            self.batch_sampling.tables.record(staged_rows.get(), sampled)
            return start_host_copy(
                requests, inputs.sampling_rows, sampled, out.logprobs, meta.num_logprobs
            )

        return sample


def stage_early_stops(
    requests: list[Request], candidates: list[int], staging: HostStaging
) -> tuple[StagedColumn, StagedColumn] | None:
    """(row, token) pairs of the EOS and stop tokens banned for rows short of ``min_tokens``,
    among ``candidates`` (the indices into ``requests`` of those with a ``min_tokens``).

    Outputs sampled by steps in flight count: ``num_pending_samples`` includes them and this
    step's own sample. A row with a grammar is left alone: its grammar decides when the
    output may end (banning the EOS a complete output needs would leave no token).
    """
    rows: list[int] = []
    tokens: list[int] = []
    for i in candidates:
        request = requests[i]
        params = request.params
        if request.grammar is not None or not params.min_tokens:
            continue
        if len(request.output_token_ids) + request.num_pending_samples - 1 >= params.min_tokens:
            continue
        banned = list(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            banned.append(request.eos_token_id)
        rows += [i] * len(banned)
        tokens += banned
    if not rows:
        return None
    return staging.add(rows, np.int64), staging.add(tokens, np.int64)


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """The generator of a request with a ``seed`` (its row's draws, whatever the batch), or
    None (the shared default generator)."""
    if seed is None:
        return None
    generator = torch.Generator(device)
    generator.manual_seed(seed)
    return generator
