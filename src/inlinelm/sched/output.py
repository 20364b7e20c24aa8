"""Typed records that leave the scheduler: the batch for the runner, and per-step outputs.

All of them are plain data (no tensors, no futures) so they can cross the thread seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from inlinelm.sched.finish import FinishReason as FinishReason  # NOTE: imported from here

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
class TokenLogprobs:
    """Logprobs at one position: the sampled token first, then the top-N, with ranks."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, for the requests whose prompt is fully computed."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


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


@dataclass(slots=True)
class EngineCoreOutputs:
    """Everything one engine step produced; posted to the frontend once per step.

    ``error`` is set (and ``outputs`` empty) exactly once, when the engine thread dies.
    """

    outputs: list[EngineCoreOutput]
    step_index: int = 0
    step_start: float = 0.0
    step_end: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    error: BaseException | None = None


class Runner(Protocol):
    """What the engine thread calls to run one step (the model, or the echo runner)."""

    num_kv_blocks: int

    def start_on_thread(self) -> None:
        """Called once on the engine thread before its first step: set up what belongs to
        the thread that runs the steps (the current CUDA device, captured CUDA graphs)."""
        ...

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the batch, write its KV, and sample one token per finished prompt."""
        ...

    def close(self) -> None:
        """Release weights, the KV cache and any device memory."""
        ...


@runtime_checkable
class PipelinedRunner(Runner, Protocol):
    """A runner whose device works while the engine thread schedules the next step.

    Steps run on the device strictly in submission order (one stream), so blocks freed
    on the engine thread while a step is in flight can go to any later step: the
    in-flight step's writes land before the later step's. A decode scheduled while the
    step that samples its input token is in flight reads that token on the device.
    """

    def submit(self, batch: SchedulerOutput) -> None:
        """Launch one step and return without waiting for it."""
        ...

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest submitted step and return its sampled tokens."""
        ...
