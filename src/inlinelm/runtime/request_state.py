"""Frontend-side state of one request (or one choice of an n>1 request), on the event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from inlinelm.runtime.collector import RequestOutputCollector
from inlinelm.runtime.outputs import CompletionOutput, RequestMetrics
from inlinelm.sampling_params import OutputKind, SamplingParams
from inlinelm.sched.output import TokenLogprobs
from inlinelm.sched.request import Request


@dataclass(slots=True, eq=False)
class ParentRequest:
    """What the choices of one request share: the caller's collector, metrics and progress."""

    request_id: str
    collector: RequestOutputCollector
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    params: SamplingParams
    num_choices: int
    child_ids: list[str]
    num_finished: int = 0
    num_cached_tokens: int = 0
    queued: bool = True
    timeout: asyncio.TimerHandle | None = None
    # n > 1: engine requests of the other choices, sent once the first has its prompt cached.
    deferred: list[Request] = field(default_factory=list)
    # final_only: the finished choices, delivered together when the last one ends.
    final_choices: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.num_finished == self.num_choices


@dataclass(slots=True, eq=False)
class RequestState:
    """One engine-side sequence as the frontend sees it: detokenizer, counters, its parent."""

    request_id: str
    index: int
    parent: ParentRequest
    detokenizer: Any
    output_kind: OutputKind
    stream_interval: int
    num_sent_tokens: int = 0
    num_unsent_steps: int = 0
    num_sent_logprobs: int = 0
    logprobs: list[TokenLogprobs] | None = field(default=None)
