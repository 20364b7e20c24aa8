"""Frontend-side state of one request (or one choice of an n>1 request), on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inlinelm.runtime.collector import RequestOutputCollector
from inlinelm.runtime.outputs import CompletionOutput, RequestMetrics
from inlinelm.sampling_params import OutputKind, SamplingParams
from inlinelm.sched.output import TokenLogprobs
from inlinelm.sched.request import Request

if TYPE_CHECKING:
    from inlinelm.detok import StopStrings
    from inlinelm.reasoning import ReasoningParser, ReasoningStream


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
    queued: bool = False  # counted in the queue (CoreHandle.enqueue) until its first token
    timeout: asyncio.TimerHandle | None = None
    # n > 1: engine requests of the other choices, sent once the first has its prompt cached.
    deferred: list[Request] = field(default_factory=list)
    # final_only: the finished choices, delivered together when the last one ends.
    final_choices: list[CompletionOutput] = field(default_factory=list)
    # A pooling request's result; the prompt's logprobs (prompt_logprobs), first entry None.
    pooled: list[float] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

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
    logprobs: list[TokenLogprobs] | None = field(default=None)
    # A reasoning model's chat: its text split into reasoning and answer as it is released
    # (and, but in delta mode, each part so far).
    reasoning: ReasoningStream | None = None
    reasoning_so_far: str = ""
    answer_so_far: str = ""


def make_states(
    request_id: str,
    submission: int,
    prompt_ids: list[int],
    params: SamplingParams,
    arrival: float,
    make_detokenizer: Callable[[StopStrings | None], Any],
    *,
    max_backlog_bytes: int,
    stream_interval: int,
    reasoning: ReasoningParser | None = None,
) -> tuple[ParentRequest, list[RequestState]]:
    """The frontend state of a new request: its parent, and one state per choice.

    The choices' engine-side ids are ``"<submission>:<request_id>"`` (``…#i`` for n > 1):
    unique per submission whatever the caller's id, so a late output or abort of an earlier
    request with the same caller id can never reach this one. ``make_detokenizer`` makes a
    choice's detokenizer from the request's stop strings, built here once for all choices.
    With ``reasoning``, each choice's text is split into its reasoning and its answer.
    """
    delta = params.output_kind is OutputKind.DELTA
    collector = RequestOutputCollector(delta=delta, max_backlog_bytes=max_backlog_bytes)
    key = f"{submission}:{request_id}"
    child_ids = [key] if params.n == 1 else [f"{key}#{i}" for i in range(params.n)]
    parent = ParentRequest(
        request_id, collector, prompt_ids, RequestMetrics(arrival), params, params.n, child_ids
    )
    stops = stop_strings(params)
    children = [
        RequestState(
            cid,
            i,
            parent,
            make_detokenizer(stops),
            params.output_kind,
            stream_interval,
            reasoning=None if reasoning is None else reasoning.stream(),
        )
        for i, cid in enumerate(child_ids)
    ]
    return parent, children


def stop_strings(params: SamplingParams) -> StopStrings | None:
    """The request's stop strings, prepared for matching (None when it has none).

    Built once per request: its choices share the table read-only, each keeping only its own
    matcher state. The build does a few string operations per stop, whatever their lengths.
    """
    if not params.stop:
        return None
    # NOTE: imported here like the detokenizers: they load with the engine (tokenizers)
    from inlinelm.detok import StopStrings

    return StopStrings(params.stop)


def engine_requests(
    parent: ParentRequest,
    children: list[RequestState],
    eos_token_id: int | None,
    arrival: float,
    *,
    share_prefix: bool,
) -> list[Request]:
    """The engine requests to send now, one per choice; with ``share_prefix`` (n > 1 and
    prefix caching) only the first, the others waiting in ``parent.deferred`` until it has
    computed the prompt, so they read its KV blocks from the prefix cache."""
    params = parent.params
    requests = [
        Request(
            child.request_id,
            parent.prompt_token_ids,
            params if params.n == 1 else params.for_choice(i),
            eos_token_id,
            arrival_time=arrival,
        )
        for i, child in enumerate(children)
    ]
    share = share_prefix and params.n > 1
    parent.deferred = requests[1:] if share else []
    return requests[:1] if share else requests
