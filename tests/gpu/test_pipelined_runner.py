"""The model runner driven pipelined (step N+1 submitted before step N is collected), on
the CPU: greedy, penalised and seeded outputs equal the plain loop's, through a stop on
EOS mid-pipeline, an abort in flight and preemption."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inlinelm.config import EngineConfig
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.engine_core import EngineCore
from inlinelm.sched.output import EngineCoreOutputs, SchedulerOutput
from inlinelm.sched.request import Request
from inlinelm.sched.runner import PipelinedRunner
from inlinelm.sched.scheduler import Scheduler
from tests.gpu.reference import PROMPTS
from tests.gpu.test_model_runner import run_to_completion

OnCollect = Callable[[int, Scheduler], None]


def run_pipelined(
    runner: ModelRunner,
    scheduler: Scheduler,
    requests: list[Request],
    on_collect: OnCollect | None = None,
) -> dict[str, list[int]]:
    """The engine's pipelined loop, step by step: schedule and submit N+1, then collect N.

    ``on_collect(n, scheduler)`` runs just before step ``n`` is collected (N+1 in flight).
    """
    for request in requests:
        scheduler.add_request(request)
    in_flight: deque[SchedulerOutput] = deque()
    collected = 0
    while scheduler.has_unfinished_requests() or in_flight:
        submitted = False
        if scheduler.has_unfinished_requests():
            batch = scheduler.schedule()
            if batch.scheduled:
                runner.submit(batch)
                in_flight.append(batch)
                submitted = True
            else:
                scheduler.keep_removed(batch.removed_ids)
        if len(in_flight) > 1 or (in_flight and not submitted):
            if on_collect is not None:
                on_collect(collected, scheduler)
            scheduler.update_from_output(in_flight.popleft(), runner.collect())
            collected += 1
        assert collected < 10_000
    return {r.request_id: list(r.output_token_ids) for r in requests}


def _config(folder: Path, **options: Any) -> EngineConfig:
    return EngineConfig(model=str(folder), **{"num_kv_blocks": 256, **options})


def _both(
    folder: Path,
    make: Callable[[], list[Request]],
    on_collect: OnCollect | None = None,
    *,
    static: bool = False,
    device: str = "cpu",
    **options: Any,
) -> tuple[dict[str, list[int]], dict[str, list[int]], list[Request]]:
    """Plain (eager) outputs, then pipelined ones (through the static decode with ``static``,
    captured when ``device`` is CUDA)."""
    config = _config(folder, device=device, **options)
    plain = run_to_completion(
        ModelRunner(config.with_options(enforce_eager=True), folder),
        Scheduler(config, config.num_kv_blocks or 0, 2),
        make(),
    )
    runner = ModelRunner(config, folder)
    if static:
        runner.build_graphs(capture=device != "cpu")
    scheduler = Scheduler(config, runner.num_kv_blocks, 2)
    requests = make()
    piped = run_pipelined(runner, scheduler, requests, on_collect)
    assert scheduler.num_free_blocks == runner.num_kv_blocks
    return plain, piped, requests


def _prompts(tokenizer: Any, params: SamplingParams, tag: str = "r") -> list[Request]:
    return [Request(f"{tag}{i}", tokenizer(p).input_ids, params, 2) for i, p in enumerate(PROMPTS)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"num_kv_blocks": 4, "max_num_batched_tokens": 32},
    ],
    ids=["one-shot", "chunks-of-7", "preemption"],
)
def test_pipelined_greedy_equals_plain(
    options: dict[str, Any], tiny_model_dir: Path, tokenizer: Any
) -> None:
    plain, piped, requests = _both(tiny_model_dir, lambda: _prompts(tokenizer, GREEDY), **options)
    assert piped == plain
    if options.get("num_kv_blocks") == 4:
        assert any(r.num_preemptions for r in requests), "no request was preempted"


def test_pipelined_static_decode_equals_plain(tiny_model_dir: Path, tokenizer: Any) -> None:
    """Decode inputs sampled in flight reach the static buffers too."""
    plain, piped, _ = _both(
        tiny_model_dir, lambda: _prompts(tokenizer, GREEDY), static=True, max_model_len=128
    )
    assert piped == plain


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["eager", "graphs"])
def test_pipelined_greedy_equals_plain_on_cuda(
    static: bool, tiny_model_dir: Path, tokenizer: Any
) -> None:
    def abort_r0(step: int, scheduler: Scheduler) -> None:
        if step == 3:
            scheduler.abort_requests(["r0"])

    plain, piped, _ = _both(
        tiny_model_dir,
        lambda: _prompts(tokenizer, GREEDY),
        abort_r0,
        static=static,
        device="cuda",
        max_model_len=128,
    )
    assert piped["r0"] == plain["r0"][: len(piped["r0"])]
    assert {k: v for k, v in piped.items() if k != "r0"} == {
        k: v for k, v in plain.items() if k != "r0"
    }


def test_stop_on_eos_mid_pipeline(tiny_model_dir: Path, tokenizer: Any) -> None:
    config = _config(tiny_model_dir)
    free = run_to_completion(
        ModelRunner(config, tiny_model_dir), Scheduler(config, 256, 2), _prompts(tokenizer, GREEDY)
    )
    eos = free["r1"][4]  # r1 stops at its 5th token (or earlier if it came sooner)
    stop_at = free["r1"].index(eos) + 1
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def make() -> list[Request]:
        requests = _prompts(tokenizer, GREEDY)
        requests[1] = Request("r1", requests[1].prompt_token_ids, params, eos)
        return requests

    plain, piped, requests = _both(tiny_model_dir, make)
    assert piped == plain
    assert piped["r1"] == free["r1"][:stop_at]
    assert requests[1].finish_reason is not None and requests[1].finish_reason.value == "stop"


def test_abort_in_flight(tiny_model_dir: Path, tokenizer: Any) -> None:
    def abort_r0(step: int, scheduler: Scheduler) -> None:
        if step == 3:
            scheduler.abort_requests(["r0"])

    plain, piped, _ = _both(tiny_model_dir, lambda: _prompts(tokenizer, GREEDY), abort_r0)
    assert 0 < len(piped["r0"]) < len(plain["r0"])
    assert piped["r0"] == plain["r0"][: len(piped["r0"])]
    assert {k: v for k, v in piped.items() if k != "r0"} == {
        k: v for k, v in plain.items() if k != "r0"
    }


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logit_bias={2: 100.0}),
    ],
    ids=["frequency", "repetition", "seeded", "min-tokens"],
)
def test_pipelined_sampling_state_equals_plain(
    params: SamplingParams, tiny_model_dir: Path, tokenizer: Any
) -> None:
    plain, piped, _ = _both(tiny_model_dir, lambda: _prompts(tokenizer, params))
    assert piped == plain


def test_engine_core_runs_the_cpu_model_runner_pipelined(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    config = _config(tiny_model_dir, async_scheduling=True)
    plain = run_to_completion(
        ModelRunner(config, tiny_model_dir), Scheduler(config, 256, 2), _prompts(tokenizer, GREEDY)
    )
    runner = ModelRunner(config, tiny_model_dir)
    assert isinstance(runner, PipelinedRunner) and not runner.overlaps
    tokens: dict[str, list[int]] = {}
    done = threading.Event()

    def sink(batch: EngineCoreOutputs) -> None:
        for output in batch.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if batch.error is not None or sum(map(len, tokens.values())) == 12 * len(PROMPTS):
            done.set()

    core = EngineCore(config, runner, 2, sink)
    submits: list[int] = []
    submit = runner.submit

    def counting(batch: SchedulerOutput) -> None:
        submits.append(len(runner._in_flight))
        submit(batch)

    runner.submit = counting  # type: ignore[method-assign]
    core.start()
    for request in _prompts(tokenizer, GREEDY):
        core.add_request(request)
    assert done.wait(60)
    core.shutdown()
    assert core.join(30)
    assert tokens == plain
    assert max(submits) == 1  # a step was submitted while another was in flight
