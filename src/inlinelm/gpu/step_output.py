"""A submitted step's sampled ids (and logprobs) on their way to the host.

On CUDA they are copied into pinned host memory without blocking, and an event recorded
after the copies tells :meth:`StepInFlight.wait` when they landed (its wait releases the
GIL). On the CPU the tensors are the host's already.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from inlinelm.gpu.attention.metadata import IntArray
from inlinelm.gpu.sampling.sampler import LogprobsTensors, SamplerOutput, to_token_logprobs
from inlinelm.sched.output import TokenLogprobs
from inlinelm.sched.request import Request
from inlinelm.sched.runner import ModelRunnerOutput


@dataclass(slots=True)
class StepInFlight:
    """A submitted step: its sampling requests and rows, and its ids on their way to the host."""

    requests: list[Request]
    rows: IntArray
    sampled: torch.Tensor  # [len(requests)] int64 on the host (pinned on CUDA)
    logprobs: LogprobsTensors | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    ready: torch.cuda.Event | None = None  # recorded after the copies (CUDA)
    # The step's prompt outputs (see PromptOutputs), on the host already.
    pooled: dict[str, list[float]] | None = None
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None

    def wait(self) -> None:
        """Block until the copies landed (a no-op on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()  # NOTE: releases the GIL while it waits

    def output(self, sampled: npt.NDArray[np.int64]) -> ModelRunnerOutput:
        """The step's output for the scheduler, once landed (``sampled``: its ids as numpy)."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = to_token_logprobs(
                SamplerOutput(self.sampled, self.logprobs), self.num_logprobs
            )
        return ModelRunnerOutput(
            req_ids=[r.request_id for r in self.requests],
            sampled_token_ids=sampled.tolist(),
            logprobs=logprobs,
            pooled=self.pooled,
            prompt_logprobs=self.prompt_logprobs,
        )


def start_host_copy(
    requests: list[Request],
    rows: IntArray,
    sampled: torch.Tensor,
    logprobs: LogprobsTensors | None,
    num_logprobs: list[int | None],
) -> StepInFlight:
    """Start copying a step's samples to the host; the returned record waits for them."""
    cuda = sampled.device.type == "cuda"
    host_logprobs = None
    if logprobs is not None:
        host_logprobs = LogprobsTensors(
            _to_host(logprobs.sampled_logprobs, cuda),
            _to_host(logprobs.sampled_ranks, cuda),
            _to_host(logprobs.top_token_ids, cuda),
            _to_host(logprobs.top_logprobs, cuda),
        )
    step = StepInFlight(requests, rows, _to_host(sampled, cuda), host_logprobs, num_logprobs)
    if cuda:
        step.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch stub
        step.ready.record()
    return step


def _to_host(tensor: torch.Tensor, cuda: bool) -> torch.Tensor:
    if not cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
