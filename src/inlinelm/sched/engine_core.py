"""The engine thread: drains inputs, runs scheduler and runner steps, posts one batch per step.

Everything here runs on the ``inlinelm-engine`` thread except the input helpers
(:meth:`EngineCore.put` and friends) and the stats, which any thread may call or read.
The thread never awaits; when there is nothing to do it blocks on its input queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inlinelm.config import EngineConfig
from inlinelm.sched.output import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput
from inlinelm.sched.request import FinishReason, Request
from inlinelm.sched.runner import ModelRunnerOutput, PipelinedRunner, Runner
from inlinelm.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AddRequest:
    """Input: schedule a new request."""

    request: Request


@dataclass(slots=True)
class AbortRequests:
    """Input: abort these requests (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True)
class Shutdown:
    """Input: finish the current step, release everything and exit the thread."""


EngineCoreInput = AddRequest | AbortRequests | Shutdown


@dataclass(frozen=True, slots=True)
class EngineCoreStats:
    """A snapshot taken after each step; safe to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_kv_blocks: int = 0
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_steps: int = 0


class EngineCore:
    """Owns the scheduler and the runner, and runs them on one dedicated thread.

    ``sink`` is called on the engine thread exactly once per step with that step's
    :class:`EngineCoreOutputs` (``step_index`` counts steps from 0), once more when aborts
    arrive while no step runs (their ``ABORT`` outputs, ``step_index`` of the next step),
    and once with ``error`` set if the thread dies. It must not block for long: the next
    step waits for it. ``scheduler`` and ``runner`` belong to the engine thread once it
    started; other threads read :attr:`stats`.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        eos_token_id: int | None,
        sink: Callable[[EngineCoreOutputs], None],
    ) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(
            config, runner.num_kv_blocks, eos_token_id, runner.long_context_from
        )
        self._sink = sink
        self._inputs: queue.SimpleQueue[EngineCoreInput] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._pending: list[EngineCoreOutput] = []
        self._shutdown = False
        self._step_index = 0
        self._stats = EngineCoreStats()
        self._publish_stats()

    # -- any thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (once); returns when the runner is set up on it, and
        raises what that set-up raised (the thread has then exited)."""
        assert self._thread is None, "EngineCore.start() called twice"
        self._thread = threading.Thread(target=self._run, name="inlinelm-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to exit; returns True once it has (or was never started)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def put(self, record: EngineCoreInput) -> None:
        """Send one input to the engine thread (never blocks)."""
        self._inputs.put(record)

    def add_request(self, request: Request) -> None:
        """Queue ``request``; the engine thread owns it from now on."""
        self.put(AddRequest(request))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Ask the engine thread to abort these requests (no output of theirs follows the
        step in which the abort is applied, except one ``FinishReason.ABORT`` output)."""
        self.put(AbortRequests(list(request_ids)))

    def shutdown(self) -> None:
        """Ask the engine thread to exit after the current step."""
        self.put(Shutdown())

    @property
    def stats(self) -> EngineCoreStats:
        """The snapshot published after the last step."""
        return self._stats

    # -- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.runner.start_on_thread()
        except BaseException as exc:
            self._start_error = exc
            self._release(None)
            return
        finally:
            self._started.set()
        error: BaseException | None = None
        try:
            self._loop()
        except BaseException as exc:  # anything: the frontend must hear that we died
            error = exc
        error = self._release(error)
        if error is not None:
            self._sink(EngineCoreOutputs(outputs=[], step_index=self._step_index, error=error))

    def _loop(self) -> None:
        if self.config.async_scheduling and isinstance(self.runner, PipelinedRunner):
            self._loop_pipelined(self.runner)
            return
        while not self._shutdown:  # NOTE: a Shutdown drained mid-step must not block below.
            busy = self.scheduler.has_unfinished_requests()
            self._drain_inputs(block=not busy and not self._pending)
            if self._shutdown:
                return  # a shutdown seen mid-step lets that step finish first
            if self.scheduler.has_unfinished_requests():
                self._step()
            elif self._pending:
                self._flush_pending()

    def _step(self) -> None:
        """One engine step: schedule, execute, apply mid-step aborts, update, post."""
        step_start = time.perf_counter()
        # 1) decide the batch
        batch = self.scheduler.schedule()
        # 2) run it; the runner writes KV into the batch's blocks until it returns
        out = self.runner.execute(batch)
        # 3) NOTE: inputs that arrived during execute() are applied only now, after it
        # returned: freeing an aborted request's blocks earlier could hand them to another
        # request while this step still writes them. An aborted request gets no token from
        # this step (update_from_output skips finished requests).
        # 4) apply what was sampled, and post
        self._finish_step(out, batch, step_start)

    def _loop_pipelined(self, runner: PipelinedRunner) -> None:
        """Like :meth:`_loop`, but step N+1 is scheduled and submitted before step N is
        collected, so the scheduler's and this thread's Python run while the device works.

        Inputs are applied between steps as in :meth:`_loop`; freeing blocks of a request
        in the step still in flight is safe because the device runs steps in order.
        """
        in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        while not self._shutdown:  # NOTE: a Shutdown drained mid-step must not block below.
            busy = in_flight or self.scheduler.has_unfinished_requests()
            self._drain_inputs(block=not busy and not self._pending)
            if self._shutdown:
                break  # the step in flight finishes first, below
            submitted = False
            if self.scheduler.has_unfinished_requests():
                step_start = time.perf_counter()
                batch = self.scheduler.schedule()
                if batch.scheduled:
                    runner.submit(batch)
                    in_flight.append((batch, step_start))
                    submitted = True
                else:
                    self.scheduler.keep_removed(batch.removed_ids)
            if len(in_flight) > 1 or (in_flight and not submitted):
                self._finish_step(runner.collect(), *in_flight.popleft())
            elif self._pending and not in_flight:
                self._flush_pending()
        while in_flight:
            self._finish_step(runner.collect(), *in_flight.popleft())

    def _finish_step(
        self, out: ModelRunnerOutput, batch: SchedulerOutput, step_start: float
    ) -> None:
        """Apply aborts that arrived meanwhile, then the step's tokens; post the outputs."""
        self._drain_inputs(block=False)
        outputs = self.scheduler.update_from_output(batch, out)
        self._step_index += 1
        self._publish_stats()
        self._post([*self._take_pending(), *outputs], self._step_index - 1, step_start)

    def _flush_pending(self) -> None:
        """Post abort outputs when no step follows to carry them."""
        self._publish_stats()
        self._post(self._take_pending(), self._step_index, time.perf_counter())

    def _post(self, outputs: list[EngineCoreOutput], step_index: int, step_start: float) -> None:
        self._sink(
            EngineCoreOutputs(
                outputs=outputs,
                step_index=step_index,
                step_start=step_start,
                step_end=time.perf_counter(),
            )
        )

    def _drain_inputs(self, *, block: bool) -> None:
        """Apply queued inputs; with ``block``, wait for the first one (the idle state)."""
        if block:
            self._apply(self._inputs.get())
        while not self._shutdown:
            try:
                record = self._inputs.get_nowait()
            except queue.Empty:
                return
            self._apply(record)

    def _apply(self, record: EngineCoreInput) -> None:
        if isinstance(record, AddRequest):
            self._add(record.request)
        elif isinstance(record, AbortRequests):
            aborted = self.scheduler.abort_requests(record.request_ids)
            self._pending.extend(_abort_output(request_id) for request_id in aborted)
        else:
            self._shutdown = True

    def _add(self, request: Request) -> None:
        """Queue ``request``; if that raises (submit let something through), fail only it.

        NOTE: the last line of defence of invariant 11. A fault here is traced to one
        request; one inside a batched step (schedule, execute, update) is not, and kills the
        engine thread (invariant 8)."""
        try:
            self.scheduler.add_request(request)
        except Exception:
            logger.exception("request %s could not be added; failing it", request.request_id)
            self.scheduler.finish_requests([request.request_id], FinishReason.ERROR)
            self._pending.append(
                EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            )

    def _take_pending(self) -> list[EngineCoreOutput]:
        pending, self._pending = self._pending, []
        return pending

    def _release(self, error: BaseException | None) -> BaseException | None:
        """Free every request's blocks, then close the runner; returns the first error."""
        for release in (self._finish_all, self.runner.close):
            try:
                release()
            except Exception as exc:
                error = error or exc
        return error

    def _finish_all(self) -> None:
        self.scheduler.finish_all(FinishReason.ABORT)
        self._publish_stats()

    def _publish_stats(self) -> None:
        # NOTE: one reference swap, so readers on other threads see a consistent snapshot.
        scheduler, cache = self.scheduler, self.scheduler.prefix_cache_stats
        self._stats = EngineCoreStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_free_blocks=scheduler.num_free_blocks,
            num_kv_blocks=scheduler.num_kv_blocks,
            num_prefix_queried_tokens=cache.num_queried_tokens,
            num_prefix_hit_tokens=cache.num_hit_tokens,
            num_steps=self._step_index,
        )


def _abort_output(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT)
