"""What a step returns besides its sampled tokens: pooled results and prompt logprobs
(engine thread).

A step holding a pooling request's last prompt token, or a chunk of a prompt whose
logprobs were asked for, runs eagerly (never a CUDA graph) and reads the final hidden
states of those rows beside the sampling rows' in the same forward. Results reach the host
before the step's output is made (a sync on CUDA: these are prefill steps, whose forward
dwarfs it).

A decoder pools the last token, or the mean or the first of every token: means are summed
chunk by chunk in :class:`PoolSums`, kept by the runner across steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.input_batch import StepInputs
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.pooling import embeddings, token_pair_scores
from inlinelm.gpu.step_forward import RunModel
from inlinelm.sched.output import SchedulerOutput, TokenLogprobs
from inlinelm.sched.pooling import Pooling
from inlinelm.sched.request import Request

PROMPT_LOGPROB_ROWS = 256
"""Prompt positions whose full-vocabulary logits are held at once (a chunk's ``[rows, V]``
float32 logits would otherwise be hundreds of MB for a large vocabulary)."""


@dataclass(slots=True)
class PoolSum:
    """A decoder pooling request's hidden states so far: their sum, count and the first."""

    total: torch.Tensor
    count: int
    first: torch.Tensor


PoolSums = dict[str, PoolSum]
"""The runner's running pools by request id (mean and CLS pooling over chunks)."""


@dataclass(slots=True)
class _Slice:
    """One request's tokens in the step: flat rows ``lo..hi-1``, positions from ``start``."""

    request: Request
    lo: int
    hi: int
    start: int
    last: bool  # the step computes its last prompt token


@dataclass(slots=True)
class PromptOutputs:
    """The step's requests that pool or want prompt logprobs, and what they got."""

    pooling: list[_Slice]
    logprobs: list[_Slice]
    pooled: dict[str, list[float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: SchedulerOutput, inputs: StepInputs) -> PromptOutputs | None:
        """The step's prompt outputs, or None for a step without any (the common case:
        one pass over the scheduled requests' two fields)."""
        scheduled = batch.scheduled
        wanted = [
            i
            for i, item in enumerate(scheduled)
            if item.request.pooling is not None or item.request.params.prompt_logprobs is not None
        ]
        if not wanted:
            return None
        starts = inputs.query_start_loc
        pooling, logprobs = [], []
        for i in wanted:
            item = scheduled[i]
            request = item.request
            lo, hi = int(starts[i]), int(starts[i + 1])
            last = item.start + item.num_tokens >= request.num_prompt_tokens
            piece = _Slice(request, lo, hi, item.start, last)
            if request.pooling is not None:
                pooling.append(piece)
            elif item.start < request.num_prompt_tokens - 1:
                logprobs.append(piece)
        if not pooling and not logprobs:
            return None  # NOTE: decodes of requests whose prompt logprobs are done
        return cls(pooling, logprobs)

    def forward(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        plan: Callable[[AttentionMetadata], None],
        sums: PoolSums,
    ) -> RunModel:
        """The step's forward (``plan`` readies attention for its metadata): the hidden
        states of :meth:`rows` come back beside the sampling rows' and become the results;
        the sampling rows' logits are returned."""
        rows = torch.from_numpy(self.rows()).to(model.embed_tokens.weight.device)

        def run(
            meta: AttentionMetadata,
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            logits_indices: torch.Tensor,
        ) -> torch.Tensor:
            plan(meta)
            wanted = torch.cat([logits_indices, rows])
            hidden = model.hidden_states(input_ids, positions, kv_caches, meta, wanted)
            num_sampling = len(logits_indices)
            self.read(hidden[num_sampling:], model.compute_logits, sums)
            return model.compute_logits(hidden[:num_sampling])

        return run

    def rows(self) -> np.ndarray:
        """The flat rows whose hidden states the step must return (beside the sampling
        rows): every row of a pooling chunk, every prompt row of a logprobs chunk."""
        spans = [np.arange(s.lo, s.hi) for s in (*self.pooling, *self.logprobs)]
        return np.concatenate(spans).astype(np.int64)

    def read(
        self,
        hidden: torch.Tensor,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        sums: PoolSums,
    ) -> None:
        """Make the results from ``hidden`` (the hidden states of :meth:`rows`, in order);
        ``logits_of`` is the model's LM head."""
        offset = 0
        for piece in self.pooling:
            n = piece.hi - piece.lo
            self._pool(piece, hidden[offset : offset + n], logits_of, sums)
            offset += n
        for piece in self.logprobs:
            n = piece.hi - piece.lo
            self._prompt_logprobs(piece, hidden[offset : offset + n], logits_of)
            offset += n

    def _pool(
        self,
        piece: _Slice,
        hidden: torch.Tensor,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        sums: PoolSums,
    ) -> None:
        request = piece.request
        pooling = request.pooling
        assert pooling is not None
        rid = request.request_id
        if pooling.method != "last":
            _accumulate(sums, rid, hidden, first=piece.start == 0)
        if not piece.last:
            return
        if pooling.head == "token_pair":
            self.pooled[rid] = token_pair_scores(logits_of(hidden[-1:]), [pooling])[0]
            return
        self.pooled[rid] = embeddings(
            _pooled(pooling, hidden, sums.pop(rid, None))[None], [pooling]
        )[0]

    def _prompt_logprobs(
        self,
        piece: _Slice,
        hidden: torch.Tensor,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Logprobs of prompt tokens ``start+1 ..`` from the logits at ``start ..``."""
        request = piece.request
        k = request.params.prompt_logprobs
        assert k is not None
        prompt = request.prompt_token_ids
        end = min(piece.start + (piece.hi - piece.lo), len(prompt) - 1)
        entries: list[TokenLogprobs] = []
        for lo in range(piece.start, end, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, end)
            rows = hidden[lo - piece.start : hi - piece.start]
            targets = torch.tensor(prompt[lo + 1 : hi + 1], device=hidden.device)
            entries.extend(_token_logprobs(logits_of(rows), targets, k))
        self.prompt_logprobs[request.request_id] = (piece.start, entries)


def _accumulate(sums: PoolSums, rid: str, hidden: torch.Tensor, *, first: bool) -> None:
    total = hidden.float().sum(dim=0)
    kept = sums.get(rid)
    if first or kept is None:
        sums[rid] = PoolSum(total, len(hidden), hidden[0].clone())
    else:
        kept.total += total
        kept.count += len(hidden)


def _pooled(pooling: Pooling, hidden: torch.Tensor, kept: PoolSum | None) -> torch.Tensor:
    if pooling.method == "last":
        return hidden[-1]
    assert kept is not None, "a mean or CLS pooling summed every chunk"
    if pooling.method == "cls":
        return kept.first
    return (kept.total / kept.count).to(hidden.dtype)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Each row's target token first (logprob, 1-based rank), then its top ``k``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > target).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
    ids, lps, tids, tlps = (
        targets.tolist(),
        target[:, 0].tolist(),
        top_ids.tolist(),
        top_lp.tolist(),
    )
    return [
        TokenLogprobs([ids[i], *tids[i]], [lps[i], *tlps[i]], ranks[i]) for i in range(len(ids))
    ]
