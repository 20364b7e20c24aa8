"""What the engine thread asks of a runner (the model, or the echo runner), and what one
step gives back: the seam between ``sched/`` and ``gpu/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from inlinelm.sched.output import SchedulerOutput, TokenLogprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, for the requests whose prompt is fully computed."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    # Pooling requests whose last prompt token this step computed: their results.
    pooled: dict[str, list[float]] | None = None
    # Prompt logprobs computed this step, by request: ``(first prompt index, entries)``,
    # entry ``i`` for prompt token ``first + i``.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None


class Runner(Protocol):
    """What the engine thread calls to run one step (the model, or the echo runner)."""

    num_kv_blocks: int
    long_context_from: int | None
    """A request whose sequence grows past this many tokens is computed again from its first
    token, once (a longrope model's positions all rotate differently past it); None: never."""

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
