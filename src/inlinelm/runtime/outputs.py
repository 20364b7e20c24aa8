"""What a caller receives: ``RequestOutput`` (one request) holding ``CompletionOutput`` choices,
with ``TokenLogprobs`` per position when logprobs were asked for (the engine thread's record,
re-exported here as the public type)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inlinelm.sched.output import TokenLogprobs as TokenLogprobs  # re-exported: a public type


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.perf_counter()`` seconds) and derived latencies of one request."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_merged_outputs: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Seconds from arrival to the end."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        lats = self.inter_token_latencies
        return sum(lats) / len(lats) if lats else None

    def __repr__(self) -> str:
        # NOTE: the latencies' summary, not the list of every inter-token latency.
        def ms(seconds: float | None) -> str:
            return "None" if seconds is None else f"{1e3 * seconds:.2f} ms"

        return (
            f"RequestMetrics(ttft={ms(self.ttft)}, tpot={ms(self.tpot)}, e2e={ms(self.e2e)}, "
            f"inter_token_latencies=[{len(self.inter_token_latencies)} values], "
            f"num_merged_outputs={self.num_merged_outputs})"
        )


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request: its text and tokens (new ones only in delta mode).

    A reasoning model's chat (a reasoning parser on: ``Engine(reasoning_parser=...)``)
    has its thinking in ``reasoning`` and only the answer in ``text``, split exactly at
    the tags with no tag text in either; ``reasoning_tokens`` (on a finished choice)
    counts the output tokens of the reasoning, its tags included. Both are None without
    a parser.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    reasoning: str | None = None
    reasoning_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """News about a request: a delta, the text so far, or the final result (per output_kind).

    For ``n == 1`` the properties ``text``, ``token_ids``, ``finish_reason``, ``stop_reason``
    and ``logprobs`` read the single choice; with ``n > 1`` read ``outputs`` (each has its
    ``index``). ``finished`` is true once every choice has finished.
    """

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # A pooling request's result (Engine.embed's vector, Engine.score's scores).
    pooled: list[float] | None = None
    # With SamplingParams(prompt_logprobs=k): one entry per prompt token, None for the
    # first (nothing predicts it), else its logprob and rank, then its top k.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason if self.outputs else None

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs if self.outputs else None


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding (``Engine.embed``): ``index`` is its place among the inputs,
    ``num_prompt_tokens`` the tokens the model read (its prompt and special tokens
    included)."""

    index: int
    embedding: list[float]
    num_prompt_tokens: int


@dataclass(slots=True)
class ScoreOutput:
    """One document's relevance to the query (``Engine.score``), in [0, 1]: a
    cross-encoder's sigmoid, a decoder reranker's probability of "yes". ``index`` is the
    document's place among the documents."""

    index: int
    score: float
    num_prompt_tokens: int


def merge_choice(
    choices: list[CompletionOutput], new: CompletionOutput, *, delta: bool, copy: bool = False
) -> None:
    """Fold ``new`` into the choice of ``choices`` with its index: appended to it when
    ``delta`` (text, token ids, logprobs; the finish reason replaced), else replacing it.
    A choice seen for the first time is appended, as a copy with ``copy`` (when ``new``
    also reaches the caller, who must not see it grow)."""
    for i, old in enumerate(choices):
        if old.index != new.index:
            continue
        if not delta:
            choices[i] = new
            return
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if new.logprobs is not None:
            old.logprobs = (old.logprobs or []) + new.logprobs
        if new.reasoning is not None:
            old.reasoning = (old.reasoning or "") + new.reasoning
        if new.reasoning_tokens is not None:
            old.reasoning_tokens = new.reasoning_tokens
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        return
    if copy:
        new = CompletionOutput(
            new.index,
            new.text,
            list(new.token_ids),
            new.finish_reason,
            new.stop_reason,
            new.logprobs,
            new.reasoning,
            new.reasoning_tokens,
        )
    choices.append(new)


def aborted_output(parent: Any, indices: list[int]) -> RequestOutput:
    """The last output of a request its owner aborted: its open choices end with ``abort``."""
    choices = [CompletionOutput(i, "", [], "abort") for i in indices]
    return RequestOutput(
        parent.request_id,
        choices,
        True,
        parent.prompt_token_ids,
        parent.metrics,
        parent.num_cached_tokens,
    )
