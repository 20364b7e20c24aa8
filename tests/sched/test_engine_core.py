"""EngineCore on its own thread, driven by the EchoRunner.

Every test runs twice: with the pipelined loop (the next step is scheduled while the
echo "device" runs this one) and with the plain loop (``async_scheduling=False``).
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from typing import Any

import pytest

from inlinelm.config import EngineConfig
from inlinelm.gpu.echo_runner import EchoRunner
from inlinelm.sched.engine_core import AbortRequests, AddRequest, EngineCore, Shutdown
from inlinelm.sched.output import EngineCoreOutputs, SchedulerOutput
from inlinelm.sched.request import FinishReason, Request
from inlinelm.sched.runner import ModelRunnerOutput
from tests.sched.helpers import make_request as shared_make_request

EOS = 2
WAIT_S = 20.0


def expected_echo(prompt: list[int], max_tokens: int) -> list[int]:
    """What the echo runner answers ``prompt`` with (its own rule)."""
    return EchoRunner.expected(prompt, max_tokens, eos_token_id=EOS)


def make_request(request_id: str, prompt: list[int], **params: Any) -> Request:
    return shared_make_request(request_id, prompt, eos_token_id=EOS, **params)


class Sink:
    """Collects what the engine thread posts; ``done`` is set when ``expected`` all finished."""

    def __init__(self, expected: set[str] | None = None) -> None:
        self.expected = expected or set()
        self.batches: list[EngineCoreOutputs] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, FinishReason] = {}
        self.done = threading.Event()
        # The running requests each post saw (set ``core`` to record them; the core
        # publishes its stats before it posts the step).
        self.core: EngineCore | None = None
        self.running: list[int] = []

    def __call__(self, batch: EngineCoreOutputs) -> None:
        assert threading.current_thread().name == "inlinelm-engine"
        self.batches.append(batch)
        if self.core is not None:
            self.running.append(self.core.stats.num_running)
        for output in batch.outputs:
            assert output.request_id not in self.finished, "output after finish"
            self.tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                self.finished[output.request_id] = output.finish_reason
        if batch.error is not None or self.expected <= self.finished.keys():
            self.done.set()

    def batches_with(self, request_id: str) -> list[int]:
        return [
            b.step_index for b in self.batches if any(o.request_id == request_id for o in b.outputs)
        ]


class GatedRunner(EchoRunner):
    """Pauses while collecting step ``gate_step`` until the test releases it."""

    def __init__(self, *args: Any, gate_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate_step = gate_step
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = False

    def collect(self) -> ModelRunnerOutput:
        out = super().collect()
        if self.num_steps == self.gate_step:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return out

    def close(self) -> None:
        self.closed = True
        super().close()


class FailingRunner(EchoRunner):
    """Raises ``error`` while collecting step ``fail_step``."""

    def __init__(self, *args: Any, fail_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_step = fail_step
        self.error = RuntimeError("device fell over")
        self.closed = False

    def collect(self) -> ModelRunnerOutput:
        if self.num_steps + 1 == self.fail_step:
            raise self.error
        return super().collect()

    def close(self) -> None:
        self.closed = True
        super().close()


PIPELINED = [True]
"""Whether this test's engine core runs the pipelined loop (set per test by ``loop_mode``)."""


@pytest.fixture(autouse=True, params=[True, False], ids=["pipelined", "plain"])
def loop_mode(request: pytest.FixtureRequest) -> None:
    PIPELINED[0] = request.param


def make_config(**options: Any) -> EngineConfig:
    return EngineConfig(**{"runner": "echo", "async_scheduling": PIPELINED[0], **options})


def start_core(runner: EchoRunner, sink: Sink, config: EngineConfig | None = None) -> EngineCore:
    core = EngineCore(config or make_config(), runner, EOS, sink)
    core.start()
    return core


def stop_core(core: EngineCore) -> None:
    core.shutdown()
    assert core.join(WAIT_S)


def test_256_concurrent_requests_get_their_exact_echo() -> None:
    rng = random.Random(7)
    prompts = {
        f"r{i}": [rng.randrange(10, 5000) for _ in range(rng.randrange(1, 48))] for i in range(256)
    }
    config = make_config(max_num_batched_tokens=16384)
    sink = Sink(set(prompts))
    core = EngineCore(config, EchoRunner(config, 2048, EOS, check_kv=True), EOS, sink)
    sink.core = core
    # All queued before the thread starts, so the first step admits all 256 at once.
    for request_id, prompt in prompts.items():
        core.add_request(make_request(request_id, prompt, max_tokens=40))
    core.start()
    assert sink.done.wait(WAIT_S)
    stop_core(core)
    for request_id, prompt in prompts.items():
        assert sink.tokens[request_id] == expected_echo(prompt, 40)
    assert [b.step_index for b in sink.batches] == list(range(len(sink.batches)))
    assert all(b.step_start <= b.step_end for b in sink.batches)
    assert max(sink.running) == 256
    assert sink.running[-1] == 0
    assert core.stats.num_free_blocks == core.stats.num_kv_blocks == 2048


def test_a_tiny_kv_cache_preempts_and_still_completes_everything() -> None:
    config = make_config(block_size=4, max_model_len=64)
    prompts = {f"r{i}": list(range(100 + i, 130 + i)) for i in range(32)}
    sink = Sink(set(prompts))
    core = start_core(EchoRunner(config, 40, EOS, check_kv=True), sink, config)
    for request_id, prompt in prompts.items():
        core.add_request(make_request(request_id, prompt, max_tokens=32))
    assert sink.done.wait(WAIT_S)
    stop_core(core)
    assert core.scheduler.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert sink.tokens[request_id] == expected_echo(prompt, 32)
    assert core.stats.num_free_blocks == 40
    assert core.stats.num_prefix_hit_tokens > 0
    assert core.stats.num_prefix_queried_tokens > core.stats.num_prefix_hit_tokens


def test_exits_on_shutdown_when_idle() -> None:
    config = make_config()
    runner = GatedRunner(config, 64, EOS, gate_step=-1)
    sink = Sink()
    core = start_core(runner, sink, config)
    assert core.is_alive
    stop_core(core)
    assert not core.is_alive
    assert runner.closed
    assert sink.batches == []


def test_shutdown_mid_step_posts_that_step_and_frees_every_block() -> None:
    config = make_config()
    runner = GatedRunner(config, 64, EOS, gate_step=2)
    sink = Sink()
    core = start_core(runner, sink, config)
    core.add_request(make_request("a", [10, 11, 12], max_tokens=100, ignore_eos=True))
    assert runner.entered.wait(WAIT_S)
    core.put(Shutdown())
    runner.release.set()
    assert core.join(WAIT_S)
    # Pipelined, the step after the gated one is already in flight: it finishes too.
    num_steps = 3 if PIPELINED[0] else 2
    assert [b.step_index for b in sink.batches] == list(range(num_steps))
    assert sink.tokens["a"] == [10, 11, 12][:num_steps]
    assert runner.closed
    assert core.stats.num_free_blocks == 64
    assert not core.scheduler.has_unfinished_requests()


def test_runner_error_is_reported_once_and_the_thread_exits_with_blocks_free() -> None:
    config = make_config()
    runner = FailingRunner(config, 64, EOS, fail_step=3)
    sink = Sink()
    core = start_core(runner, sink, config)
    core.add_request(make_request("a", [10, 11, 12], max_tokens=100, ignore_eos=True))
    core.add_request(make_request("b", list(range(10, 40)), max_tokens=100, ignore_eos=True))
    assert sink.done.wait(WAIT_S)
    assert core.join(WAIT_S)
    errors = [b for b in sink.batches if b.error is not None]
    assert len(errors) == 1
    assert errors[0].error is runner.error
    assert errors[0].outputs == []
    assert sink.batches[-1] is errors[0]
    assert runner.closed
    assert core.stats.num_free_blocks == 64
    assert core.scheduler.num_free_blocks == 64


def test_abort_mid_step_gets_no_further_output_and_add_mid_step_is_queued() -> None:
    config = make_config()
    runner = GatedRunner(config, 64, EOS, gate_step=3)
    sink = Sink({"b", "c"})
    core = start_core(runner, sink, config)
    core.add_request(make_request("a", [10, 11, 12, 13, 14], max_tokens=100, ignore_eos=True))
    core.add_request(make_request("b", [20, 21, 22, 23, 24], max_tokens=5))
    assert runner.entered.wait(WAIT_S)  # step 3 (index 2) is executing
    core.abort(["a"])
    core.add_request(make_request("c", [30, 31], max_tokens=5))
    runner.release.set()
    assert sink.done.wait(WAIT_S)
    stop_core(core)
    # a got the tokens of steps 0 and 1 only, then ABORT in step 2, then nothing.
    assert sink.tokens["a"] == [10, 11]
    assert sink.finished["a"] is FinishReason.ABORT
    assert sink.batches_with("a") == [0, 1, 2]
    assert sink.tokens["b"] == [20, 21, 22, 23, 24]
    assert sink.tokens["c"] == [30, 31, EOS]
    # c is admitted by the first step scheduled after the abort was applied.
    assert min(sink.batches_with("c")) == (4 if PIPELINED[0] else 3)
    assert core.stats.num_free_blocks == 64


def test_abort_of_a_request_that_never_ran_is_posted_without_a_step() -> None:
    config = make_config()
    sink = Sink({"a"})
    core = EngineCore(config, EchoRunner(config, 64, EOS), EOS, sink)
    core.put(AddRequest(make_request("a", [10, 11], max_tokens=5)))
    core.put(AbortRequests(["a", "unknown"]))
    core.start()
    assert sink.done.wait(WAIT_S)
    stop_core(core)
    [batch] = sink.batches
    assert [(o.request_id, o.finish_reason) for o in batch.outputs] == [("a", FinishReason.ABORT)]
    assert batch.step_index == 0


def test_abort_after_finish_is_ignored() -> None:
    config = make_config()
    sink = Sink({"a"})
    core = start_core(EchoRunner(config, 64, EOS), sink, config)
    core.add_request(make_request("a", [10, 11], max_tokens=5))
    assert sink.done.wait(WAIT_S)
    num_batches = len(sink.batches)
    core.abort(["a"])
    stop_core(core)
    assert len(sink.batches) == num_batches
    assert sink.finished["a"] is FinishReason.STOP


def test_shutdown_drained_mid_step_of_the_last_work_does_not_block() -> None:
    """A Shutdown taken while the final step of the last request runs ends the thread."""
    config = make_config()
    runner = GatedRunner(config, 64, EOS, gate_step=1)
    sink = Sink()
    core = start_core(runner, sink, config)
    core.add_request(make_request("a", [10, 11, 12], max_tokens=1))
    assert runner.entered.wait(WAIT_S)
    core.put(Shutdown())
    runner.release.set()
    assert core.join(WAIT_S)
    assert sink.tokens["a"] == [10]
    assert runner.closed


class RecordingRunner(EchoRunner):
    """Logs ("submit" | "collect", step number) in the order the engine thread calls them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []
        self._num_submitted = 0

    def submit(self, batch: SchedulerOutput) -> None:
        self.calls.append(("submit", self._num_submitted))
        self._num_submitted += 1
        super().submit(batch)

    def collect(self) -> ModelRunnerOutput:
        self.calls.append(("collect", self.num_steps))
        return super().collect()


def test_pipelined_loop_submits_the_next_step_before_collecting_this_one() -> None:
    config = make_config(echo_step_s=0.001)
    runner = RecordingRunner(config, 64, EOS)
    sink = Sink({"a"})
    core = start_core(runner, sink, config)
    core.add_request(make_request("a", [10, 11, 12, 13], max_tokens=4))
    assert sink.done.wait(WAIT_S)
    stop_core(core)
    assert sink.tokens["a"] == [10, 11, 12, 13]
    calls = runner.calls
    if PIPELINED[0]:
        # Step n+1 is launched while step n runs: the device never waits for the host.
        assert calls[:4] == [("submit", 0), ("submit", 1), ("collect", 0), ("submit", 2)]
    else:
        assert calls[:4] == [("submit", 0), ("collect", 0), ("submit", 1), ("collect", 1)]
    # max_tokens is known ahead: no step is launched past the fourth token.
    assert calls.count(("submit", 4)) == 0


class ThreadSetupRunner(EchoRunner):
    """Records the thread ``start_on_thread`` runs on, and raises ``error`` there if set."""

    def __init__(self, *args: Any, error: BaseException | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error = error
        self.setup_thread: str | None = None
        self.closed = False

    def start_on_thread(self) -> None:
        self.setup_thread = threading.current_thread().name
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True
        super().close()


def test_the_runner_is_set_up_on_the_engine_thread_before_start_returns() -> None:
    config = make_config()
    runner = ThreadSetupRunner(config, 64, EOS)
    core = start_core(runner, Sink(), config)
    try:
        assert runner.setup_thread == "inlinelm-engine"
    finally:
        core.shutdown()
        assert core.join(WAIT_S)


def test_a_runner_set_up_that_fails_raises_from_start_and_releases_the_runner() -> None:
    config = make_config()
    error = RuntimeError("injected: graph capture fell over")
    runner = ThreadSetupRunner(config, 64, EOS, error=error)
    core = EngineCore(config, runner, EOS, Sink())
    with pytest.raises(RuntimeError) as info:
        core.start()
    assert info.value is error
    assert runner.closed
    assert not core.is_alive
