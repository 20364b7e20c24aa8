"""Engine-side request state: plain data owned by the engine thread.

The scheduler mutates it; the runner reads it (``request_id``, ``prompt_token_ids``,
``output_token_ids``, ``all_token_ids``, ``block_ids``, ``params``, ``grammar``, and the
position to compute from in each :class:`~inlinelm.sched.output.ScheduledRequest`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inlinelm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inlinelm.sched.logprobs import TokenLogprobs
    from inlinelm.sched.pooling import Pooling
    from inlinelm.structured.matcher import GrammarMatcher, ReasoningGate


class FinishReason(enum.Enum):
    """Why a request stopped: OpenAI's ``finish_reason`` values plus ``error``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.Enum):
    """Where a request is in its life on the engine thread."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        """True for every ``FINISHED_*`` status."""
        return self in _FINISHED

    @classmethod
    def finished(cls, reason: FinishReason) -> RequestStatus:
        """The final status that matches a finish reason."""
        return _STATUS_OF_REASON[reason]


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated: its tokens, its progress and its KV blocks.

    ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose KV is in
    ``block_ids``. Preemption resets it to 0 and empties ``block_ids``; the output so far is
    kept and recomputed with the prompt on re-admission.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = 0
    # Chain hashes of the full blocks of ``all_token_ids`` computed so far (a pure function
    # of the tokens and ``long_context``, so they stay valid across preemption).
    block_hashes: list[int] = field(default_factory=list)
    # Computed as a sequence past the runner's ``long_context_from`` (set once it is admitted
    # that long; its blocks hash apart from the same tokens' in a shorter sequence).
    long_context: bool = False
    num_preemptions: int = 0
    # Scheduled in a step whose output is not applied yet (only with a pipelined runner can
    # these be nonzero when the next step is scheduled): tokens being computed, and tokens
    # being sampled (placeholders for output not known on this thread yet).
    num_inflight_tokens: int = 0
    num_pending_samples: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Structured output: the grammar state, which has consumed exactly ``output_token_ids``
    # (so it survives preemption unchanged). The runner masks logits with it; the scheduler
    # feeds it each sampled token.
    grammar: GrammarMatcher | None = None
    # A reasoning model's grammar while it thinks: ``grammar`` once the output closes its
    # reasoning (see ReasoningGate); the scheduler and runner treat the request as
    # constrained meanwhile, so no token is sampled past the tag unmasked.
    grammar_gate: ReasoningGate | None = None
    # A pooling request: computes its prompt once and returns a vector, never a token.
    pooling: Pooling | None = None
    # The prompt's logprobs as steps compute them (``params.prompt_logprobs`` set): entry
    # ``j`` for prompt token ``j + 1``; sent with the first sampled token.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Prompt then output tokens: a live list kept by append_output_token; read it, never
    # mutate it. A plain field, not a property: the step path reads it for every request.
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def priority(self) -> int:
        """Admission priority: lower values are admitted first."""
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not computed yet (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request stopped for any reason."""
        return self.status.is_finished

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether it reads every prompt position's result (its prompt logprobs, or a
        pooling over all tokens): a prefix from the cache would skip them, so it takes none."""
        pooling = self.pooling
        return self.params.prompt_logprobs is not None or (
            pooling is not None and pooling.needs_every_position
        )

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
