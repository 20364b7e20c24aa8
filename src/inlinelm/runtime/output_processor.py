"""Turns engine-step outputs into ``RequestOutput`` objects for collectors (event loop).

``process_outputs`` is the only per-step loop over the batch on the event loop
(DESIGN invariant 2): detokenize → stop strings → build the output → collector.put.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from inlinelm.errors import InlineLMError, RequestError, RequestFailedError, SlowConsumerError
from inlinelm.runtime.metrics import EngineMetrics
from inlinelm.runtime.outputs import CompletionOutput, RequestOutput
from inlinelm.runtime.request_state import ParentRequest, RequestState
from inlinelm.sampling_params import OutputKind
from inlinelm.sched.output import EngineCoreOutput
from inlinelm.sched.request import FinishReason

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Holds the states of one event loop's live requests and processes their outputs."""

    def __init__(
        self,
        on_started: Callable[[ParentRequest], None],
        on_removed: Callable[[ParentRequest], None],
        metrics: EngineMetrics,
    ) -> None:
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self._on_started = on_started
        self._on_removed = on_removed
        self._metrics = metrics

    def add(self, parent: ParentRequest, children: list[RequestState]) -> None:
        """Register a request and its choices (before its ADD leaves for the engine)."""
        self.parents[parent.request_id] = parent
        for child in children:
            self.states[child.request_id] = child

    def remove(self, parent: ParentRequest) -> list[str]:
        """Forget a request; returns the engine-side ids of its unfinished choices."""
        if self.parents.get(parent.request_id) is parent:
            del self.parents[parent.request_id]
            self._on_removed(parent)
        if parent.timeout is not None:
            parent.timeout.cancel()
        return [cid for cid in parent.child_ids if self.states.pop(cid, None) is not None]

    def open_choices(self, parent: ParentRequest) -> list[int]:
        """Indices of the choices of ``parent`` that have not finished."""
        return [self.states[cid].index for cid in parent.child_ids if cid in self.states]

    def process_outputs(self, outputs: list[EngineCoreOutput], step_start: float) -> list[str]:
        """Process one slice of a step's outputs; return engine ids to abort (stop strings, slow readers)."""
        now = time.perf_counter()
        to_abort: list[str] = []
        states = self.states
        for out in outputs:
            state = states.get(out.request_id)
            if state is None:
                continue  # NOTE: aborted or another loop's request; dropped by design.
            try:
                self._process_one(state, out, now, step_start, to_abort)
            except Exception as exc:  # NOTE: one request's fault (its detokenizer …) is its own
                logger.exception("request %s failed in the output handler", out.request_id)
                error = RequestFailedError(
                    f"request {state.parent.request_id} failed in the output handler: "
                    f"{type(exc).__name__}"
                )
                error.__cause__ = exc
                self._fail_request(state.parent, error, to_abort)
        return to_abort

    def _fail_request(
        self, parent: ParentRequest, error: InlineLMError, to_abort: list[str]
    ) -> None:
        to_abort.extend(self.remove(parent))
        parent.collector.put(error)
        self._metrics.observe_finished("error", None, [], None, parent.collector.num_merges)

    def _process_one(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        now: float,
        step_start: float,
        to_abort: list[str],
    ) -> None:
        # NOTE: runs once per token per request; the common case (a token, no finish, no
        # logprobs, a stream that sends every step) takes no call it can avoid.
        parent = state.parent
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        if out.finish_reason is not None:
            if out.finish_reason is FinishReason.ERROR:
                self._fail_request(parent, _engine_failure(parent, out), to_abort)
                return
            finish_reason, stop_reason = _finish_of(out)
        if out.pooled is not None or out.prompt_logprobs is not None:
            _keep_prompt_results(parent, out)
            if out.pooled is not None:
                self._record_first_token(parent, out, now, step_start)
        if out.new_token_ids:
            metrics = parent.metrics
            last = metrics.last_token_time
            if metrics.first_token_time is None:
                self._record_first_token(parent, out, now, step_start)
            elif last is not None and now > last:
                metrics.inter_token_latencies.append(now - last)
            metrics.last_token_time = now
            detokenizer = state.detokenizer
            stop = detokenizer.update(out.new_token_ids, stop_token=finish_reason == "stop")
            if state.reasoning is not None:
                state.reasoning.mark(len(detokenizer.output_token_ids), detokenizer.num_chars)
            if stop is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", stop
                to_abort.append(state.request_id)
        if out.new_logprobs:
            state.logprobs = (state.logprobs or []) + out.new_logprobs
        finished = finish_reason is not None
        if finished:
            self.states.pop(state.request_id, None)
            parent.num_finished += 1
            if parent.finished:
                self.remove(parent)
        elif (
            state.stream_interval != 1 or state.output_kind is OutputKind.FINAL_ONLY
        ) and not self._due(state):
            return
        self._emit(state, finish_reason, stop_reason, to_abort)
        if finished and parent.finished:
            self._observe_finished(parent, finish_reason, now)  # NOTE: after the last put

    def _observe_finished(self, parent: ParentRequest, reason: str | None, now: float) -> None:
        m = parent.metrics
        m.finished_time = now
        self._metrics.observe_finished(
            reason or "stop", m.ttft, m.inter_token_latencies, m.e2e, parent.collector.num_merges
        )

    def _record_first_token(
        self, parent: ParentRequest, out: EngineCoreOutput, now: float, step_start: float
    ) -> None:
        metrics = parent.metrics
        metrics.scheduled_time = step_start
        metrics.first_token_time = now
        parent.num_cached_tokens = out.num_cached_tokens
        if parent.timeout is not None:
            parent.timeout.cancel()
            parent.timeout = None
        self._on_started(parent)

    def _due(self, state: RequestState) -> bool:
        """stream_interval: send the first token at once, then every N-th step."""
        if state.output_kind is OutputKind.FINAL_ONLY:
            return False
        if state.num_sent_tokens == 0:
            return True
        state.num_unsent_steps += 1
        return state.num_unsent_steps >= state.stream_interval

    def _emit(
        self,
        state: RequestState,
        finish_reason: str | None,
        stop_reason: int | str | None,
        to_abort: list[str],
    ) -> None:
        delta = state.output_kind is OutputKind.DELTA
        finished = finish_reason is not None
        reasoning = reasoning_tokens = None
        if state.reasoning is None:
            text = state.detokenizer.next_output_text(finished, delta)
        else:
            text, reasoning = _split_reasoning(state, finished, delta)
        if not text and not reasoning and not finished and not state.logprobs:
            return  # NOTE: nothing a reader could show; the ids go out with the next text.
        all_ids = state.detokenizer.output_token_ids
        if finished and state.reasoning is not None:
            reasoning_tokens = state.reasoning.reasoning_tokens(len(all_ids))
        token_ids = all_ids[state.num_sent_tokens :] if delta else list(all_ids)
        state.num_unsent_steps = 0
        state.num_sent_tokens = len(all_ids)
        logprobs = state.logprobs
        if delta:
            state.logprobs = None
        choice = CompletionOutput(
            state.index,
            text,
            token_ids,
            finish_reason,
            stop_reason,
            logprobs,
            reasoning,
            reasoning_tokens,
        )
        parent = state.parent
        if state.output_kind is OutputKind.FINAL_ONLY:
            # NOTE: one output for the whole request, holding every choice, at its very end.
            parent.final_choices.append(choice)
            if not parent.finished:
                return
            choices = sorted(parent.final_choices, key=lambda c: c.index)
        else:
            choices = [choice]
        output = RequestOutput(
            parent.request_id,
            choices,
            parent.finished,
            parent.prompt_token_ids,
            parent.metrics,
            parent.num_cached_tokens,
            parent.pooled,
            parent.prompt_logprobs,
        )
        if not parent.collector.put(output):
            self._fail_slow_consumer(parent, to_abort)

    def _fail_slow_consumer(self, parent: ParentRequest, to_abort: list[str]) -> None:
        to_abort.extend(self.remove(parent))
        parent.collector.put(
            SlowConsumerError(
                f"request {parent.request_id}: reader fell behind by over {parent.collector.max_backlog_bytes} bytes"
            )
        )

    def fail_all(self, error: BaseException) -> list[str]:
        """Hand ``error`` to every live request and forget them all; returns the engine-side
        ids of their unfinished choices."""
        ids = []
        for parent in list(self.parents.values()):
            ids.extend(self.remove(parent))
            parent.collector.put(error)
        self.states.clear()
        return ids


def _split_reasoning(state: RequestState, finished: bool, delta: bool) -> tuple[str, str | None]:
    """The answer and the reasoning of the text released now: the new parts in delta
    mode, else each part so far (None: no reasoning yet)."""
    stream = state.reasoning
    assert stream is not None
    reasoning, answer = stream.feed(state.detokenizer.next_output_text(finished, True))
    if finished:
        more_reasoning, more_answer = stream.finish()
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    if not delta:
        state.reasoning_so_far += reasoning
        state.answer_so_far += answer
        reasoning, answer = state.reasoning_so_far, state.answer_so_far
    return answer, reasoning or None


def _keep_prompt_results(parent: ParentRequest, out: EngineCoreOutput) -> None:
    """A pooling request's result, and the prompt's logprobs (from the first choice
    that brings them: every choice computes the same)."""
    if out.pooled is not None:
        parent.pooled = out.pooled
    if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
        parent.prompt_logprobs = [None, *out.prompt_logprobs]


def _finish_of(out: EngineCoreOutput) -> tuple[str | None, int | str | None]:
    if out.finish_reason is None:
        return None, None
    reason = (
        out.finish_reason.value
        if isinstance(out.finish_reason, FinishReason)
        else str(out.finish_reason)
    )
    return reason, out.stop_reason


def _engine_failure(parent: ParentRequest, out: EngineCoreOutput) -> InlineLMError:
    """The error of a request the engine ended: a ``RequestError`` naming ``structured``
    when its grammar failed (the request's own doing: a 400 before any output, an error
    frame after), else a ``RequestFailedError``."""
    if out.error is not None:
        return RequestError(f"request {parent.request_id}: {out.error}", param="structured")
    return RequestFailedError(f"request {parent.request_id} failed in the engine")
