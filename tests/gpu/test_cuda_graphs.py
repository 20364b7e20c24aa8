"""The decode-graph unit: capture sizes, the eager-fallback predicate, and the static-buffer
step (padding rows on the scratch block) against the dynamic path.

On the CPU the static-buffer step runs eagerly (``build_graphs(capture=False)``); the tests
marked ``gpu`` capture and replay real CUDA graphs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu.cuda_graphs import DecodeGraphs, GraphStep, capture_sizes
from inlinelm.gpu.input_batch import StepInputs
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request
from inlinelm.sched.scheduler import Scheduler
from tests.gpu.families import make_family_model
from tests.gpu.test_model_runner import run_to_completion

MAX_NUM_SEQS = 12  # sizes 1, 2, 4, 8, 12
MAX_MODEL_LEN = 128


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 35


def _runner(folder: Path, *, static: bool, device: str = "cpu", **options: Any) -> ModelRunner:
    config = EngineConfig(
        model=str(folder),
        device=device,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=96,
        **options,
    )
    runner = ModelRunner(config, folder)
    if static:
        runner.build_graphs(capture=device != "cpu")
    return runner


def _record_sizes(graphs: DecodeGraphs) -> list[tuple[int, int]]:
    """Wrap ``graphs.run`` to record (rows, padded size) of every static-buffer step."""
    seen: list[tuple[int, int]] = []
    run = graphs.run

    def recording(step: GraphStep, fill: Any) -> torch.Tensor:
        seen.append((step.num_rows, step.size))
        return run(step, fill)

    graphs.run = recording  # type: ignore[method-assign]
    return seen


def _random_requests(tokenizer: Any, rng: random.Random, count: int, tag: str) -> list[Request]:
    words = ["alpha", "beta", "gamma", "delta", "word", "the", "cat", "sat"]
    params = SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 6), ignore_eos=True)
    return [
        Request(
            f"{tag}{i}",
            tokenizer(" ".join(rng.choices(words, k=rng.randint(2, 40)))).input_ids,
            params,
            2,
        )
        for i in range(count)
    ]


def _tokens_both_ways(
    folder: Path, tokenizer: Any, counts: list[int], device: str = "cpu"
) -> tuple[dict[str, list[int]], dict[str, list[int]], list[tuple[int, int]]]:
    dynamic = _runner(folder, static=False, device=device, enforce_eager=True)
    static = _runner(folder, static=True, device=device)
    assert static.graphs is not None
    sizes = _record_sizes(static.graphs)
    want: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    # NOTE: one scheduler per runner: it tells the runner which rows to forget.
    dynamic_scheduler = Scheduler(dynamic.config, 96, 2)
    static_scheduler = Scheduler(static.config, 96, 2)
    for k, count in enumerate(counts):
        requests = _random_requests(tokenizer, random.Random(k), count, f"{k}-")
        want |= run_to_completion(dynamic, dynamic_scheduler, requests)
        requests = _random_requests(tokenizer, random.Random(k), count, f"{k}-")
        got |= run_to_completion(static, static_scheduler, requests)
    return want, got, sizes


def test_static_step_tokens_equal_the_dynamic_path_at_every_size(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    # Exact sizes and padded ones (3 -> 4, 5 -> 8, 11 -> 12).
    want, got, sizes = _tokens_both_ways(tiny_model_dir, tokenizer, [1, 2, 3, 4, 5, 8, 11, 12])
    assert got == want
    assert {size for _, size in sizes} == set(capture_sizes(MAX_NUM_SEQS))
    assert any(n < size for n, size in sizes)  # padding rows ran


@pytest.mark.parametrize("family", ["gemma2", "mixtral", "phi3"])
def test_static_step_tokens_equal_the_dynamic_path_for_each_layer_kind(
    family: str, tmp_path: Path, tokenizer_dir: Path, tokenizer: Any
) -> None:
    """Sliding windows shorter than the prompts and soft caps (Gemma 2), experts (Mixtral)
    and partial rotary (Phi-3) through the static-buffer decode."""
    folder = make_family_model(tmp_path / family, tokenizer_dir, family)
    want, got, sizes = _tokens_both_ways(folder, tokenizer, [1, 3, 5])
    assert got == want
    assert any(n < size for n, size in sizes)


def test_padding_rows_write_only_the_scratch_block(tiny_model_dir: Path, tokenizer: Any) -> None:
    runner = _runner(tiny_model_dir, static=True)
    before = [cache.clone() for cache in runner.kv_caches]
    scheduler = Scheduler(runner.config, runner.num_kv_blocks, 2)
    requests = _random_requests(tokenizer, random.Random(7), 3, "p")  # 3 rows run at size 4
    run_to_completion(runner, scheduler, requests)
    block = runner.config.block_size
    scratch = slice(runner.scratch_block * block, (runner.scratch_block + 1) * block)
    # The pool never hands out the scratch block; padding rows wrote into it.
    assert runner.scratch_block == runner.num_kv_blocks == scheduler.num_kv_blocks
    assert all(
        not torch.equal(c[:, scratch], b[:, scratch])
        for c, b in zip(runner.kv_caches, before, strict=True)
    )


def _inputs(max_query_len: int, num_rows: int) -> StepInputs:
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(
        input_ids=empty,
        positions=empty,
        slot_mapping=empty,
        query_start_loc=empty,
        seq_lens=np.ones(num_rows, dtype=np.int64),
        block_tables=np.zeros((num_rows, 1), dtype=np.int64),
        logits_indices=empty,
        sampling_rows=empty,
        sampling_positions=empty,
        max_query_len=max_query_len,
        max_seq_len=1,
        pending_tokens=empty,
        pending_rows=empty,
    )


def test_can_replay_holds_every_eager_fallback(tiny_model_dir: Path) -> None:
    runner = _runner(tiny_model_dir, static=True, max_cuda_graph_batch_size=8)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.can_replay(_inputs(1, 8))
    assert not graphs.can_replay(_inputs(2, 3))  # a prefill or mixed step
    assert not graphs.can_replay(_inputs(1, 9))  # above the largest graph
    runner.close()
    assert runner.graphs is None
    graphs_closed = graphs
    assert not graphs_closed.can_replay(_inputs(1, 1))  # released


def test_cpu_runner_builds_no_graphs_by_default(tiny_model_dir: Path, tokenizer: Any) -> None:
    runner = _runner(tiny_model_dir, static=False)
    run_to_completion(
        runner,
        Scheduler(runner.config, 96, 2),
        _random_requests(tokenizer, random.Random(1), 2, "c"),
    )
    assert runner.graphs is None and not runner.overlaps


@pytest.mark.gpu
def test_graph_replay_equals_eager_at_every_size_on_cuda(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    want, got, sizes = _tokens_both_ways(
        tiny_model_dir, tokenizer, [1, 2, 3, 4, 5, 8, 11, 12], device="cuda"
    )
    assert got == want
    assert {size for _, size in sizes} == set(capture_sizes(MAX_NUM_SEQS))


def test_the_static_step_runs_outside_inference_mode(tiny_model_dir: Path) -> None:
    """The capture's warm-up on the engine thread: no parameter records autograd history,
    so the in-place KV-cache write into a view of the cache is allowed (it raised)."""
    runner = _runner(tiny_model_dir, static=True)
    graphs = runner.graphs
    assert graphs is not None
    assert not any(p.requires_grad for p in runner.model.parameters())
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    graphs._load_padding(4)
    logits = graphs._forward(4)
    assert logits.shape == (4, runner.model_config.vocab_size) and not logits.requires_grad
    runner.close()


def test_every_size_writes_its_logits_into_one_shared_buffer(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """One static [max size, V] output for all graphs, not one per size."""
    runner = _runner(tiny_model_dir, static=True)
    graphs = runner.graphs
    assert graphs is not None
    assert graphs.logits.shape == (MAX_NUM_SEQS, runner.model_config.vocab_size)
    outputs: list[torch.Tensor] = []
    run = graphs.run

    def recording(step: GraphStep, fill: Any) -> torch.Tensor:
        outputs.append(run(step, fill))
        return outputs[-1]

    graphs.run = recording  # type: ignore[method-assign]
    scheduler = Scheduler(runner.config, 96, 2)
    for count in (1, 3, 12):
        run_to_completion(
            runner,
            scheduler,
            _random_requests(tokenizer, random.Random(count), count, f"s{count}-"),
        )
    storage = graphs.logits.untyped_storage().data_ptr()
    assert {len(o) for o in outputs} >= {1, 3, 12}
    assert all(o.untyped_storage().data_ptr() == storage for o in outputs)
    runner.close()


def test_the_capture_seam_captures_every_size_largest_first(tiny_model_dir: Path) -> None:
    runner = _runner(tiny_model_dir, static=False)
    runner.build_graphs(capture=False)
    graphs = runner.graphs
    assert graphs is not None
    order: list[int] = []

    class Recording:
        def capture(self, step: Any) -> Any:
            order.append(step.args[0])  # a partial of the static step over its size
            step()
            return step

        def finish(self) -> None:
            order.append(0)

    graphs.capture(Recording())
    assert order == [*sorted(graphs.sizes, reverse=True), 0]
    runner.close()


def test_one_capture_stream_per_device_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLAS keeps a workspace per (handle, stream): a stream per engine would leak one."""
    from inlinelm.gpu import cuda_graphs

    made: list[torch.device] = []

    def stream(device: torch.device) -> object:
        made.append(device)
        return object()

    monkeypatch.setattr(cuda_graphs, "_CAPTURE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    first = cuda_graphs.capture_stream(torch.device("cuda", 0))
    assert cuda_graphs.capture_stream(torch.device("cuda", 0)) is first
    assert cuda_graphs.capture_stream(torch.device("cuda", 1)) is not first
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize(("family", "capturable"), [("mixtral", False), ("llama", True)])
def test_a_model_whose_experts_run_one_at_a_time_is_not_captured(
    family: str,
    capturable: bool,
    tmp_path: Path,
    tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the grouped GEMM (any CPU; CUDA but bf16 on SM90/SM100) a sparse MLP reads its
    expert counts on the host, which a capture cannot hold: the runner stays eager."""
    folder = make_family_model(tmp_path / family, tokenizer_dir, family)
    runner = _runner(folder, static=False)
    built: list[bool] = []
    monkeypatch.setattr(type(runner), "overlaps", property(lambda self: True))
    monkeypatch.setattr(runner, "build_graphs", lambda *, capture: built.append(capture))
    runner._ensure_graphs()
    runner._ensure_graphs()
    assert built == ([True] if capturable else [])
