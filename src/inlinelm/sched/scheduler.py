"""The scheduler: decides what each engine step computes and applies what it sampled.

It runs on the engine thread only. One step is ``schedule()`` → the runner →
``update_from_output()``. With a pipelined runner the next ``schedule()`` comes before the
previous step's update: requests then carry in-flight tokens and pending samples, and a
decode is scheduled on a token not known here yet (the device has it). A request sure to
finish in the step in flight (its length caps) is not scheduled again; one that stops on
EOS or a stop token wastes one row of the next step, whose result is dropped. A request with
a grammar is not scheduled while it has a sample in flight: its next mask needs that token
(constrained requests decode every other step of a pipelined loop; the others keep
pipelining).

Policy, in order of precedence:

1. Running requests first: decodes (one token each), then the next chunk of any prompt
   still being prefilled, within the token budget and the sequence cap.
2. When a running request needs a block and none is free, the running request with the
   highest ``priority`` value (latest admitted among equals) that is not yet scheduled in
   this step is preempted by recompute: its blocks are freed and it goes back to waiting,
   keeping its output. No new request is admitted in a step that preempted. A request
   that grows past the runner's ``long_context_from`` is preempted so too, once, and
   computed again from its first token (longrope models).
3. Then waiting requests are admitted in (priority, arrival) order, reusing their longest
   cached prefix, while blocks, budget and the sequence cap allow. The head of the queue is
   never skipped, so nobody starves behind later arrivals.
"""

from __future__ import annotations

from collections.abc import Iterable

from inlinelm.config import EngineConfig
from inlinelm.sched.budget import StepBudget
from inlinelm.sched.kv_cache_manager import (
    ComputedBlocks,
    KVCacheManager,
    PrefixCacheStats,
    served_context_len,
)
from inlinelm.sched.output import EngineCoreOutput, ScheduledRequest, SchedulerOutput
from inlinelm.sched.request import FinishReason, Request, RequestStatus
from inlinelm.sched.runner import ModelRunnerOutput
from inlinelm.sched.step_outputs import (
    finish_output,
    keep_prompt_logprobs,
    pooled_output,
    token_output,
)
from inlinelm.sched.stop_checks import check_stop
from inlinelm.sched.waiting_queue import WaitingQueue


class Scheduler:
    """Waiting and running queues, the KV cache manager, and applying each step's tokens
    (when one ends a request: :func:`~inlinelm.sched.stop_checks.check_stop`)."""

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        eos_token_id: int | None,
        long_context_from: int | None = None,
    ) -> None:
        self.config = config
        self.long_context_from = long_context_from
        self.eos_token_id = eos_token_id
        self.kv_cache = KVCacheManager(
            num_kv_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.max_model_len = served_context_len(config, num_kv_blocks)
        # A step never holds more sequences than tokens, so every running request gets a
        # token each step and none is starved by the budget.
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}
        self._removed_ids: list[str] = []
        # Whether a request finished since running was last filtered (finishing one leaves
        # it in running until then).
        self._finished_since_drop = False

    # -- queries ---------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (decoding or mid-prefill)."""
        return len(self.running)

    @property
    def num_kv_blocks(self) -> int:
        """Size of the KV block pool."""
        return self.kv_cache.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return self.kv_cache.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds."""
        return self.kv_cache.num_used_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache queried and hit token counts since start."""
        return self.kv_cache.stats

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self._requests.get(request_id)

    # -- inputs ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Its prompt must be shorter than ``max_model_len``."""
        assert request.request_id not in self._requests, f"duplicate id {request.request_id}"
        assert request.status is RequestStatus.WAITING, "add_request() of a used request"
        assert request.num_tokens < self.max_model_len, "prompt must be < max_model_len"
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        self._requests[request.request_id] = request
        self.waiting.push(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests in any state; returns the ids that were still unfinished.

        Idempotent: unknown or finished ids are ignored. Blocks go back to the pool at
        once, so the caller must not be inside a step whose runner may still write them.
        """
        return self.finish_requests(request_ids, FinishReason.ABORT)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[str]:
        """Finish unfinished requests with ``reason``; returns those that were unfinished."""
        finished = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, reason)
                finished.append(request_id)
        self._drop_finished_running()
        return finished

    def finish_all(self, reason: FinishReason) -> list[str]:
        """Finish every unfinished request, releasing all blocks."""
        return self.finish_requests(list(self._requests), reason)

    # -- schedule --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: decodes, then prefill chunks; preempt if short of blocks.

        Never exceeds ``max_num_batched_tokens`` tokens or ``max_num_seqs`` sequences.
        """
        budget = StepBudget(self.config.max_num_batched_tokens, self.max_num_seqs)
        scheduled: list[ScheduledRequest] = []
        num_preemptions = self.num_preemptions
        self._schedule_running(budget, scheduled)
        if self.num_preemptions == num_preemptions:
            self._schedule_waiting(budget, scheduled)
        removed_ids, self._removed_ids = self._removed_ids, []
        num_batched_tokens = self.config.max_num_batched_tokens - budget.num_tokens
        return SchedulerOutput(scheduled, num_batched_tokens, removed_ids)

    def _schedule_running(self, budget: StepBudget, scheduled: list[ScheduledRequest]) -> None:
        # NOTE: one pass over running, which runs for every request every step: a decode
        # whose token fits the blocks it holds is taken inline, the rest through the
        # general path; prefill chunks come after every decode.
        prefills: list[tuple[Request, int]] = []
        max_model_len = self.max_model_len
        block_size = self.config.block_size
        long_from = self.long_context_from
        running = RequestStatus.RUNNING
        for request in self.running[:]:  # a copy: preempting removes from running
            if request.status is not running:
                continue  # preempted earlier in this step
            pending = request.num_pending_samples
            num_known = len(request.all_token_ids)
            if long_from is not None and self._crosses_into_long_context(
                request, num_known + pending
            ):
                continue
            if pending and (
                request.grammar is not None
                or request.grammar_gate is not None
                or num_known + pending >= max_model_len
                or _reaches_max_tokens(request, pending)
            ):
                continue  # the step in flight finishes it, or its grammar awaits its token
            start = request.num_computed_tokens + request.num_inflight_tokens
            left = num_known + pending - start
            if left != 1:
                if left > 1:
                    prefills.append((request, left))
                continue
            if budget.num_tokens <= 0 or budget.num_seqs <= 0:
                return
            if start >= len(request.block_ids) * block_size and not self._allocate_or_preempt(
                request, 1, scheduled
            ):
                continue
            scheduled.append(ScheduledRequest(request, 1, start, True, request.num_preemptions))
            request.num_inflight_tokens += 1
            request.num_pending_samples += 1
            budget.num_tokens -= 1
            budget.num_seqs -= 1
        for request, left in prefills:
            if budget.exhausted:
                return
            if request.status is not running:
                continue  # preempted earlier in this step
            num_tokens = self._num_tokens_to_schedule(left, budget)
            if num_tokens and self._allocate_or_preempt(request, num_tokens, scheduled):
                self._take(request, num_tokens, left, budget, scheduled)

    def _schedule_waiting(self, budget: StepBudget, scheduled: list[ScheduledRequest]) -> None:
        while not budget.exhausted and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request is None or not self._admit(request, budget, scheduled):
                return

    def _crosses_into_long_context(self, request: Request, length: int) -> bool:
        """Whether ``request``, about to be ``length`` tokens long, must first be computed again
        as a long-context sequence (see ``Runner.long_context_from``): it is then preempted,
        once the step sampling its last token has landed, and re-admitted as one."""
        limit = self.long_context_from
        if limit is None or request.long_context or length <= limit:
            return False
        # NOTE: after the step in flight lands; preempting now would drop its sample.
        if not request.num_pending_samples:
            self._preempt(request)
        return True

    def _admit(
        self, request: Request, budget: StepBudget, scheduled: list[ScheduledRequest]
    ) -> bool:
        limit = self.long_context_from
        if limit is not None and not request.long_context and request.num_tokens > limit:
            request.long_context = True
            request.block_hashes.clear()  # NOTE: hashed as a shorter sequence's
        whole = request.computes_whole_prompt
        computed = ComputedBlocks() if whole else self.kv_cache.get_computed_blocks(request)
        num_new = request.num_tokens - computed.num_tokens
        num_tokens = self._num_tokens_to_schedule(num_new, budget)
        if num_tokens == 0 or not self.kv_cache.allocate_slots(request, num_tokens, computed):
            return False
        self.waiting.pop()
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = computed.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._take(request, num_tokens, num_new, budget, scheduled)
        return True

    @staticmethod
    def _take(
        request: Request,
        num_tokens: int,
        num_left: int,
        budget: StepBudget,
        scheduled: list[ScheduledRequest],
    ) -> None:
        """Put ``num_tokens`` of the ``num_left`` uncomputed tokens into this step."""
        samples = num_tokens == num_left
        start = request.num_computed_tokens + request.num_inflight_tokens
        scheduled.append(
            ScheduledRequest(request, num_tokens, start, samples, request.num_preemptions)
        )
        request.num_inflight_tokens += num_tokens
        request.num_pending_samples += samples
        budget.take(num_tokens)

    def _num_tokens_to_schedule(self, num_uncomputed: int, budget: StepBudget) -> int:
        """How many of ``num_uncomputed`` tokens fit this step (0: none)."""
        if num_uncomputed > budget.num_tokens and not self.config.enable_chunked_prefill:
            return 0
        return min(num_uncomputed, budget.num_tokens)

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, scheduled: list[ScheduledRequest]
    ) -> bool:
        """Allocate slots for ``request``, preempting others (or itself) until they fit."""
        # NOTE: the common decode case first: the tokens fit in the blocks it already holds.
        if (
            request.num_computed_tokens + request.num_inflight_tokens + num_tokens
            <= len(request.block_ids) * self.config.block_size
        ):
            return True
        while not self.kv_cache.allocate_slots(request, num_tokens):
            victim = self._pick_victim(scheduled)
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _pick_victim(self, scheduled: list[ScheduledRequest]) -> Request:
        # NOTE: requests already in this step's batch are never victims: their blocks are
        # about to be written. The caller itself is unscheduled, so a victim always exists.
        # A victim may be in a step still in flight: that step's writes to its blocks land
        # before this step's (device order), and its result for the victim is dropped.
        taken = {item.request.request_id for item in scheduled}
        candidates = [r for r in reversed(self.running) if r.request_id not in taken]
        return max(candidates, key=lambda r: r.priority)

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and send it back to waiting, keeping its output."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0
        request.num_pending_samples = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._removed_ids.append(request.request_id)
        self.waiting.push(request)

    def keep_removed(self, request_ids: list[str]) -> None:
        """Hand these removed ids to the runner with the next batch (this one never ran)."""
        self._removed_ids[:0] = request_ids

    # -- update ----------------------------------------------------------------------

    def update_from_output(
        self, batch: SchedulerOutput, out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one executed step: advance progress, append sampled tokens, finish requests.

        Returns one output per request that got a token this step. Requests finished (e.g.
        aborted) or preempted after ``batch`` was scheduled are skipped.
        """
        sampled = {request_id: i for i, request_id in enumerate(out.req_ids)}
        outputs = []
        running = RequestStatus.RUNNING
        block_size = self.config.block_size
        caching = self.kv_cache.enable_caching
        for item in batch.scheduled:
            request = item.request
            if request.status is not running or item.epoch != request.num_preemptions:
                continue  # aborted, finished or preempted while the step ran
            num_tokens = item.num_tokens
            computed = request.num_computed_tokens + num_tokens
            request.num_computed_tokens = computed
            request.num_inflight_tokens -= num_tokens
            request.num_pending_samples -= item.samples
            # NOTE: a block becomes full only when the computed count crosses a block end.
            if caching and computed // block_size != (computed - num_tokens) // block_size:
                self.kv_cache.cache_full_blocks(request)
            if out.prompt_logprobs is not None and request.request_id in out.prompt_logprobs:
                keep_prompt_logprobs(request, *out.prompt_logprobs[request.request_id])
            if request.pooling is not None:
                if out.pooled is not None and request.request_id in out.pooled:
                    self._finish(request, FinishReason.STOP)
                    outputs.append(pooled_output(request, out.pooled[request.request_id]))
                continue
            index = sampled.get(request.request_id)
            if index is not None:
                outputs.append(self._append_token(request, out, index))
        self._drop_finished_running()
        return outputs

    def _append_token(
        self, request: Request, out: ModelRunnerOutput, index: int
    ) -> EngineCoreOutput:
        output = token_output(request, out, index)
        reason = check_stop(request, output.new_token_ids[0], self.max_model_len)
        if reason is not None:
            finish_output(output, request, reason)
            self._finish(request, reason)
        return output

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Mark ``request`` finished, free its blocks and forget it (running is filtered later)."""
        request.status = RequestStatus.finished(reason)
        request.finish_reason = reason
        self.waiting.remove(request)
        self.kv_cache.free(request)
        del self._requests[request.request_id]
        self._removed_ids.append(request.request_id)
        self._finished_since_drop = True

    def _drop_finished_running(self) -> None:
        if self._finished_since_drop:
            self._finished_since_drop = False
            self.running = [r for r in self.running if not r.is_finished]


def _reaches_max_tokens(request: Request, pending: int) -> bool:
    max_tokens = request.params.max_tokens
    return max_tokens is not None and len(request.output_token_ids) + pending >= max_tokens
