"""One host-to-device copy per step: the staging buffer, and the runner's step path driven
pipelined with every sampling option, on the CPU.

On CUDA ``torch.tensor(values, device=cuda)``, ``torch.from_numpy(a).to(cuda)`` and a host
list used as an index into a device tensor each copy with a stream sync, waiting for the
step in flight. Here every host-to-device copy of the step path goes through
:func:`inlinelm.gpu.staging.copy_to_device`, whose calls are counted, and every other route
to the device is a tripwire while a step is submitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu import staging as staging_module
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.gpu.sampling.sampler import Sampler
from inlinelm.gpu.staging import HostStaging
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request
from inlinelm.sched.scheduler import Scheduler
from tests.gpu.reference import PROMPTS
from tests.gpu.sampling.test_sampler import FakeKernel
from tests.gpu.test_model_runner import run_to_completion
from tests.gpu.test_pipelined_runner import run_pipelined

CPU = torch.device("cpu")


def test_columns_of_every_dtype_and_shape_come_back_from_one_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copies: list[int] = []
    original = staging_module.copy_to_device

    def counting(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append(host.numel())
        return original(host, device)

    monkeypatch.setattr(staging_module, "copy_to_device", counting)
    staging = HostStaging(CPU)
    ints = staging.add([3, 1, 2], np.int64)
    table = staging.add(np.arange(6).reshape(2, 3), np.int64)
    small = staging.add(np.array([7, 8, 9], dtype=np.int64), np.int32)
    floats = staging.add([0.5, 1.5], np.float32)
    mask = staging.add([True, False, True], np.bool_)
    empty = staging.add([], np.int64)
    staging.send()
    assert len(copies) == 1
    assert ints.get().tolist() == [3, 1, 2] and ints.get().dtype == torch.int64
    assert table.get().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert small.get().dtype == torch.int32 and small.host().tolist() == [7, 8, 9]
    assert floats.get().tolist() == [0.5, 1.5] and mask.get().tolist() == [True, False, True]
    assert empty.get().shape == (0,)


ALL_OPTIONS = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, max_tokens=8, ignore_eos=True),
    SamplingParams(
        temperature=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        max_tokens=8,
        ignore_eos=True,
    ),
    SamplingParams(temperature=0.0, logit_bias={11: 5.0, 42: -3.0}, max_tokens=8, logprobs=3),
    SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[5], max_tokens=8),
    SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=0, ignore_eos=True),
]


class StepGuard:
    """Counts ``copy_to_device`` per submitted step; fails any other route to the device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.copies = 0
        self.per_step: list[int] = []
        original_to = torch.Tensor.to

        def copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
            self.copies += 1
            return original_to(host, device, non_blocking=True)

        monkeypatch.setattr(staging_module, "copy_to_device", copy)
        for module in (
            "model_runner",
            "cuda_graphs",
            "sampling.grammar_mask",
            "attention.page_table",
        ):
            target = f"inlinelm.gpu.{module}.copy_to_device"
            if _has(target):
                monkeypatch.setattr(target, copy)
        self._wrap_factory(monkeypatch, "tensor")
        self._wrap_factory(monkeypatch, "as_tensor")
        self._trip(monkeypatch, torch, "from_numpy", lambda *a, **k: True)
        self._trip(monkeypatch, torch.Tensor, "to", _names_a_device)
        self._trip(monkeypatch, torch.Tensor, "cuda", lambda *a, **k: True)
        self._trip(monkeypatch, torch.Tensor, "__getitem__", _host_index)
        self._trip(monkeypatch, torch.Tensor, "__setitem__", _host_index)
        self._trip(monkeypatch, torch.Tensor, "index_put_", _host_index)

    def _wrap_factory(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self._trip(monkeypatch, torch, name, lambda *a, **k: k.get("device") is not None)

    def _trip(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, bad: Any) -> None:
        original = getattr(owner, name)
        guard = self

        def tripwire(*args: Any, **kwargs: Any) -> Any:
            if guard.active and bad(*args, **kwargs):
                raise AssertionError(f"{name} on the step path: {args[1:]!r:.200} {kwargs}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, tripwire)

    def watch(self, runner: ModelRunner) -> None:
        submit = runner.submit

        def guarded(batch: Any) -> None:
            self.active, self.copies = True, 0
            try:
                submit(batch)
            finally:
                self.active = False
            self.per_step.append(self.copies)

        runner.submit = guarded  # type: ignore[method-assign]


def _has(target: str) -> bool:
    module, _, name = target.rpartition(".")
    return hasattr(__import__(module, fromlist=[name]), name)


def _names_a_device(*args: Any, **kwargs: Any) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])


def _host_index(*args: Any, **kwargs: Any) -> bool:
    """A Python list (or a list inside a tuple) as an index: a copy to the device."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) for p in parts)


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepGuard]:
    yield StepGuard(monkeypatch)


def _requests(tokenizer: Any, tag: str) -> list[Request]:
    return [
        Request(f"{tag}{i}", tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids, params, 2)
        for i, params in enumerate(ALL_OPTIONS)
    ]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-sampling", "random-kernel"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-decode"])
def test_every_step_sends_its_host_data_in_one_copy(
    static: bool, kernel: bool, tiny_model_dir: Path, tokenizer: Any, guard: StepGuard
) -> None:
    """Pipelined (tokens in flight feed decodes and penalties) with every sampling option,
    through the eager path and the static-buffer decode a CUDA graph replays; the seeded
    rows take the path a batched random kernel leaves them (``random-kernel``)."""
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=8)
    runner = ModelRunner(config, tiny_model_dir)
    if kernel:
        runner.sampler = Sampler(FakeKernel())
    if static:
        runner.build_graphs(capture=False)
        assert runner.graphs is not None
    guard.watch(runner)
    run_pipelined(runner, Scheduler(config, runner.num_kv_blocks, 2), _requests(tokenizer, "s"))
    assert len(guard.per_step) >= 8 and set(guard.per_step) == {1}


def test_greedy_steps_send_one_copy_and_their_tokens_are_unchanged(
    tiny_model_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=8)

    def make() -> list[Request]:
        return [Request(f"g{i}", tokenizer(p).input_ids, params, 2) for i, p in enumerate(PROMPTS)]

    want = run_to_completion(ModelRunner(config, tiny_model_dir), Scheduler(config, 256, 2), make())
    guard = StepGuard(monkeypatch)
    runner = ModelRunner(config, tiny_model_dir)
    runner.build_graphs(capture=False)
    guard.watch(runner)
    got = run_pipelined(runner, Scheduler(config, runner.num_kv_blocks, 2), make())
    assert got == want and set(guard.per_step) == {1}
