"""Typed records that leave the scheduler: the batch for the runner, and per-step outputs
for the event loop (the runner's own records and protocols are in ``sched/runner.py``).

All of them are plain data (no tensors, no futures) so they can cross the thread seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inlinelm.sched.logprobs import TokenLogprobs as TokenLogprobs  # re-exported
from inlinelm.sched.request import FinishReason

if TYPE_CHECKING:
    from inlinelm.sched.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request in a step: compute ``num_tokens`` tokens from position ``start``.

    ``start`` is ``request.num_computed_tokens`` plus whatever an earlier step still in
    flight computes; ``samples`` says the step samples this request's next token.
    ``epoch`` is the request's preemption count when scheduled: a step's result for a
    request preempted since then is dropped.
    """

    request: Request
    num_tokens: int
    start: int = 0
    samples: bool = False
    epoch: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    """What the runner executes this step (decodes first, then prefill chunks)."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    removed_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    # Why a request finished with FinishReason.ERROR, when it is the request's own doing
    # (its grammar failed): the caller gets it as a RequestError.
    error: str | None = None
    # A pooling request's result (its one output, which finishes it).
    pooled: list[float] | None = None
    # The prompt's logprobs (``params.prompt_logprobs``), with the request's first token:
    # one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class EngineCoreOutputs:
    """Everything one engine step produced; posted to the frontend once per step.

    ``error`` is set (and ``outputs`` empty) exactly once, when the engine thread dies.
    """

    outputs: list[EngineCoreOutput]
    step_index: int = 0
    step_start: float = 0.0
    step_end: float = 0.0
    error: BaseException | None = None
