"""The model runner driven by the real scheduler: greedy output equals transformers under
chunked prefill, prefix-cache hits and forced preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request
from inlinelm.sched.scheduler import Scheduler
from tests.gpu.conftest import GreedyReference, ReferenceModel
from tests.gpu.reference import PROMPTS

MAX_NEW = 24


def run_to_completion(
    runner: ModelRunner, scheduler: Scheduler, requests: list[Request]
) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        scheduler.update_from_output(batch, runner.execute(batch))
        steps += 1
        assert steps < 10_000
    return {r.request_id: list(r.output_token_ids) for r in requests}


def _requests(tokenizer: Any, tag: str) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [Request(f"{tag}-{i}", tokenizer(p).input_ids, params, 2) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 13, "max_num_seqs": 3},
        {"num_kv_blocks": 9, "max_num_batched_tokens": 32},
    ],
    ids=["one-shot", "chunks-of-7", "chunks-and-seq-cap", "preemption"],
)
def test_greedy_equals_transformers(
    options: dict[str, Any], tiny_model_dir: Path, tokenizer: Any, greedy_reference: GreedyReference
) -> None:
    want = [tokens[:MAX_NEW] for tokens in greedy_reference(tiny_model_dir)]
    config = EngineConfig(model=str(tiny_model_dir), **{"num_kv_blocks": 256, **options})
    runner = ModelRunner(config, tiny_model_dir)
    scheduler = Scheduler(config, runner.num_kv_blocks, 2)
    got = run_to_completion(runner, scheduler, _requests(tokenizer, "a"))
    assert [got[f"a-{i}"] for i in range(len(PROMPTS))] == want
    # A second round hits the prefix cache for every full prompt block.
    again = run_to_completion(runner, scheduler, _requests(tokenizer, "b"))
    assert [again[f"b-{i}"] for i in range(len(PROMPTS))] == want
    assert scheduler.num_free_blocks == runner.num_kv_blocks


def test_prefix_cache_is_hit(tiny_model_dir: Path, tokenizer: Any) -> None:
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)
    runner = ModelRunner(config, tiny_model_dir)
    scheduler = Scheduler(config, runner.num_kv_blocks, 2)
    long_prompt = tokenizer("word " * 40).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = run_to_completion(runner, scheduler, [Request("x", long_prompt, params, 2)])
    second_req = Request("y", long_prompt, params, 2)
    second = run_to_completion(runner, scheduler, [second_req])
    assert first["x"] == second["y"]
    assert second_req.num_cached_tokens >= 32


@pytest.fixture(scope="module")
def default_runner(default_model_dir: Path) -> Iterator[ModelRunner]:
    """One runner on the default model (0.5 GB of weights to load) for every scheduler
    set-up below. The set-ups differ in the scheduler's token budget and block pool, and the
    runner runs whatever batch it is given: each set-up gets a scheduler of its own over the
    first ``num_kv_blocks`` blocks of this runner's cache. Float weights: the greedy tokens
    are transformers' (quantized weights are tested in tests/gpu/model/test_blocks.py)."""
    runner = ModelRunner(EngineConfig(num_kv_blocks=128, quantization="none"), default_model_dir)
    yield runner
    runner.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 7},
        {"num_kv_blocks": 9, "max_num_batched_tokens": 32},
    ],
    ids=["one-shot", "chunks-of-7", "preemption"],
)
def test_default_model_greedy_equals_transformers(
    options: dict[str, Any],
    default_runner: ModelRunner,
    default_model_dir: Path,
    tokenizer: Any,
    greedy_reference: GreedyReference,
    request: pytest.FixtureRequest,
) -> None:
    config = EngineConfig(**{"num_kv_blocks": 128, **options})
    assert config.num_kv_blocks is not None
    assert config.num_kv_blocks <= default_runner.num_kv_blocks
    scheduler = Scheduler(config, config.num_kv_blocks, 2)
    want = [tokens[:MAX_NEW] for tokens in greedy_reference(default_model_dir)]
    first, second = f"{request.node.callspec.id}-d", f"{request.node.callspec.id}-e"
    got = run_to_completion(default_runner, scheduler, _requests(tokenizer, first))
    assert [got[f"{first}-{i}"] for i in range(len(PROMPTS))] == want
    # A second round hits the prefix cache.
    again = run_to_completion(default_runner, scheduler, _requests(tokenizer, second))
    assert [again[f"{second}-{i}"] for i in range(len(PROMPTS))] == want
    assert scheduler.num_free_blocks == config.num_kv_blocks


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_model_dir: Path, tokenizer: Any) -> None:
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    prompt = tokenizer(PROMPTS[2]).input_ids
    alone = run_to_completion(
        ModelRunner(config, tiny_model_dir),
        Scheduler(config, 128, 2),
        [Request("s", prompt, seeded, 2)],
    )
    runner = ModelRunner(config, tiny_model_dir)
    crowd = [Request(f"o{i}", tokenizer(p).input_ids, other, 2) for i, p in enumerate(PROMPTS)]
    mixed = run_to_completion(
        runner, Scheduler(config, 128, 2), [*crowd[:2], Request("s", prompt, seeded, 2), *crowd[2:]]
    )
    assert alone["s"] == mixed["s"]


def test_min_tokens_bans_eos(tiny_model_dir: Path, tokenizer: Any) -> None:
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)
    runner = ModelRunner(config, tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, logit_bias={2: 100.0})
    got = run_to_completion(
        runner, Scheduler(config, 64, 2), [Request("m", tokenizer("hi").input_ids, params, 2)]
    )
    assert len(got["m"]) == 10 and 2 not in got["m"]


def test_many_decodes_of_different_lengths_equal_transformers(
    tiny_model_dir: Path, tokenizer: Any, reference_model: ReferenceModel
) -> None:
    """More decode rows than one attention group, lengths interleaved, rows out of order."""
    from tests.gpu.reference import reference_greedy

    prompts = [tokenizer(" ".join(["word"] * (3 + (i * 7) % 40))).input_ids for i in range(19)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512)
    runner = ModelRunner(config, tiny_model_dir)
    requests = [Request(f"m{i}", ids, params, 2) for i, ids in enumerate(prompts)]
    got = run_to_completion(runner, Scheduler(config, 512, 2), requests)
    ref = reference_model(tiny_model_dir)
    assert [got[f"m{i}"] for i in range(19)] == [reference_greedy(ref, ids, 8) for ids in prompts]


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch: pytest.MonkeyPatch) -> None:
    from inlinelm.gpu.model_runner import runner_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert runner_device("cuda") == torch.device("cuda", 3)
    assert runner_device("cuda:1") == torch.device("cuda", 1)
    assert runner_device("cpu") == torch.device("cpu")


def test_start_on_thread_sets_an_indexed_device_in_inference_mode(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.cuda.set_device`` takes only a device with an index (its own check, faked
    here without CUDA); the graphs are built in inference mode."""
    from torch._utils import _get_device_index

    from inlinelm.gpu.model_runner import runner_device

    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8), tiny_model_dir)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runner.device = runner_device("cuda")
    current: list[int] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: current.append(_get_device_index(d, optional=False))
    )
    modes: list[bool] = []
    monkeypatch.setattr(
        runner, "_ensure_graphs", lambda: modes.append(torch.is_inference_mode_enabled())
    )
    runner.start_on_thread()
    assert current == [0] and modes == [True]
    runner.device = torch.device("cpu")
    runner.close()


def test_the_loader_checks_the_fit_once_and_the_runner_takes_its_max_model_len(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import replace

    from inlinelm.gpu import model_fit, model_runner
    from inlinelm.runtime import loader

    calls: list[Path] = []
    check = model_fit.check_model_fits

    def counted(config: EngineConfig, folder: Path) -> model_fit.ModelFit:
        calls.append(folder)
        return check(config, folder)

    monkeypatch.setattr(model_fit, "check_model_fits", counted)
    monkeypatch.setattr(model_runner, "check_model_fits", counted)
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8, max_model_len=96)
    fit = loader._check_model_fits(config, tiny_model_dir)
    assert fit is not None and fit.max_model_len == 96
    runner, max_model_len, _, _ = loader._build_runner(config, tiny_model_dir, 2, fit)
    assert calls == [tiny_model_dir] and max_model_len == 96
    assert isinstance(runner, ModelRunner) and runner.max_model_len == 96
    runner.close()
    # The runner takes the length as given: it resolves none of its own.
    runner = ModelRunner(config, tiny_model_dir, replace(fit, max_model_len=64))
    assert runner.max_model_len == 64 and calls == [tiny_model_dir]
    runner.close()
