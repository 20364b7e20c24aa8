"""KV-cache sizing: the GPU budget arithmetic on plain numbers, the CPU default from the
model and max_num_seqs, and the spec they feed; the CPU cache's memory, committed as it is
written; the K/V write into the cache."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.kv_cache import (
    TYPICAL_SEQUENCE_TOKENS,
    GpuMemoryUse,
    HostMemory,
    adjacent_pair,
    allocate_kv_cache,
    bytes_per_block,
    bytes_per_token,
    gpu_kv_cache_bytes,
    kv_cache_spec,
    write_kv,
)
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.gpu.model_memory import weight_bytes
from inlinelm.gpu.model_runner import ModelRunner

MiB, GiB = 2**20, 2**30


def test_gpu_budget_is_the_share_of_free_memory_less_what_the_engine_holds() -> None:
    use = GpuMemoryUse(free_at_start=100 * GiB, used=2 * GiB, peak_activations=3 * GiB)
    budget = gpu_kv_cache_bytes(use, utilization=0.9, reserve=512 * MiB)
    assert budget == int(100 * GiB * 0.9) - 2 * GiB - 3 * GiB - 512 * MiB


def test_a_gpu_without_room_for_the_cache_is_a_clear_error() -> None:
    use = GpuMemoryUse(free_at_start=8 * GiB, used=6 * GiB, peak_activations=1 * GiB)
    with pytest.raises(ConfigError, match="no GPU memory left for the KV cache") as info:
        gpu_kv_cache_bytes(use, utilization=0.9, reserve=512 * MiB)
    assert info.value.option == "gpu_memory_utilization"


def test_spec_on_a_gpu_turns_the_budget_into_blocks(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.5, cuda_graph_memory_bytes=0)
    per_block = bytes_per_block(cfg, config.block_size, torch.bfloat16)
    use = GpuMemoryUse(free_at_start=4 * GiB, used=1 * GiB, peak_activations=256 * MiB)
    spec = kv_cache_spec(config, cfg, 2048, torch.bfloat16, use)
    assert spec.num_blocks == (2 * GiB - 1 * GiB - 256 * MiB) // per_block
    assert (
        spec.bytes_per_block
        == per_block
        == 16 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    )


def test_the_graph_reserve_is_kept_only_when_graphs_are_captured(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    use = GpuMemoryUse(free_at_start=4 * GiB, used=1 * GiB, peak_activations=256 * MiB)
    graphs = EngineConfig(device="cuda", cuda_graph_memory_bytes=512 * MiB)
    eager = graphs.with_options(enforce_eager=True)
    with_graphs = kv_cache_spec(graphs, cfg, 2048, torch.bfloat16, use)
    without = kv_cache_spec(eager, cfg, 2048, torch.bfloat16, use)
    per_block = with_graphs.bytes_per_block
    assert without.num_blocks - with_graphs.num_blocks in (
        512 * MiB // per_block,
        512 * MiB // per_block + 1,
    )


def test_explicit_sizes_win_over_the_measurement(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    use = GpuMemoryUse(free_at_start=4 * GiB, used=1 * GiB, peak_activations=0)
    blocks = EngineConfig(device="cuda", num_kv_blocks=77)
    assert kv_cache_spec(blocks, cfg, 2048, torch.bfloat16, use).num_blocks == 77
    budget = EngineConfig(device="cuda", kv_cache_bytes=64 * MiB)
    per_block = bytes_per_block(cfg, 16, torch.bfloat16)
    assert kv_cache_spec(budget, cfg, 2048, torch.bfloat16, use).num_blocks == 64 * MiB // per_block


ROOMY = HostMemory(weights=2**40, left=None)
"""Bounds that leave the CPU default to max_num_seqs x the typical length."""


def test_bytes_per_token_is_k_and_v_of_every_layer(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)  # 2 layers, 2 KV heads, head dim 16
    assert bytes_per_token(cfg, torch.float32) == 2 * 2 * 2 * 16 * 4 == 512
    assert bytes_per_token(cfg, torch.bfloat16) == 256
    assert bytes_per_block(cfg, 16, torch.float32) == 16 * 512


def test_cpu_default_is_max_num_seqs_sequences_of_a_typical_length(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    short = kv_cache_spec(EngineConfig(max_num_seqs=4), cfg, 160, torch.float32, host=ROOMY)
    assert short.num_blocks == 4 * 160 // 16
    long = kv_cache_spec(EngineConfig(max_num_seqs=4), cfg, 4096, torch.float32, host=ROOMY)
    assert long.num_blocks == 4 * TYPICAL_SEQUENCE_TOKENS // 16
    assert long.reason == f"max_num_seqs 4 x {TYPICAL_SEQUENCE_TOKENS} tokens x 512.0 B/token"


def test_cpu_default_is_bounded_by_the_weights_and_half_the_memory_left(
    tiny_model_dir: Path,
) -> None:
    cfg = read_model_config(tiny_model_dir)
    config = EngineConfig(max_num_seqs=256)
    per_block = bytes_per_block(cfg, 16, torch.float32)
    weights = HostMemory(weights=600 * per_block + 5, left=None)
    spec = kv_cache_spec(config, cfg, 512, torch.float32, host=weights)
    assert spec.num_blocks == 600 and spec.reason.startswith("the weights' size, less than")
    memory = HostMemory(weights=600 * per_block, left=2 * 100 * per_block)
    spec = kv_cache_spec(config, cfg, 512, torch.float32, host=memory)
    assert spec.num_blocks == 100 and spec.reason.startswith("half the 1.6 MiB of memory left")
    # Never less than one max_model_len sequence (check_fits judges whether that fits).
    tight = HostMemory(weights=per_block, left=0)
    spec = kv_cache_spec(config, cfg, 512, torch.float32, host=tight)
    assert spec.num_blocks == 512 // 16
    assert spec.reason == "one max_model_len sequence: 512 tokens x 512.0 B/token"


def test_an_engine_sizes_its_cpu_cache_to_the_model_and_logs_why(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inlinelm.gpu.model_runner")
    engine = Engine(model=str(tiny_model_dir), num_threads=1)  # max_num_seqs 256
    try:
        engine.start_sync()
        cfg = read_model_config(tiny_model_dir)
        per_block = bytes_per_block(cfg, 16, torch.float32)
        # 256 x 2048 tokens x 512 B would be 256 MiB: the ~25 MiB of weights bound it.
        num_blocks = engine.num_kv_blocks
    finally:
        engine.close()
    assert num_blocks == weight_bytes(cfg, torch.float32) // per_block
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"KV cache: {num_blocks} blocks of 16 tokens = ")
    assert (
        "(the weights' size, less than max_num_seqs 256 x 2048 tokens x 512.0 B/token" in lines[0]
    )
    assert lines[0].endswith("; set kv_cache_bytes= to change")


def test_an_explicit_size_is_given_as_text_and_named_in_the_reason(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    spec = kv_cache_spec(EngineConfig(kv_cache_bytes="4MiB"), cfg, 2048, torch.float32)
    assert spec.num_blocks == 4 * 2**20 // (16 * 512)
    assert spec.reason == "kv_cache_bytes='4MiB'"


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's VmRSS")
def test_a_cpu_cache_takes_memory_only_as_it_is_written(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    num_blocks = 64 * 2**20 // bytes_per_block(cfg, 16, torch.float32)  # 64 MiB
    before = _resident_bytes()
    caches = allocate_kv_cache(num_blocks, 16, cfg, torch.float32, torch.device("cpu"))
    size = sum(c.numel() * c.element_size() for c in caches)
    assert all(c.min() == c.max() == 0 for c in caches), "a fresh cache reads as zeros"
    assert _resident_bytes() - before < size / 8, "reading the cache committed its pages"
    for cache in caches:
        cache[:, : cache.shape[1] // 2] = 1.0
    assert _resident_bytes() - before > size / 2 * 0.9, "the written half is resident"
    del caches, cache
    assert _resident_bytes() - before < size / 8, "a freed cache is unmapped"


def _count_index_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = torch.Tensor.index_copy_

    def counting(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> Any:
        calls.append(dim)
        return original(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", counting)
    return calls


def test_k_and_v_of_one_fused_projection_are_written_in_one_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FlashInfer layout: q, k, v head slices of one QKV row, RoPE applied in place."""
    heads, kv_heads, dim, tokens = 4, 2, 8, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    k = qk.view(tokens, heads + kv_heads, dim)[:, heads:]
    v = v.reshape(tokens, kv_heads, dim)
    slots = torch.tensor([9, 2, 0, 14, 5])
    want = torch.zeros(2, 16, kv_heads, dim)
    want[0, slots], want[1, slots] = k, v
    calls = _count_index_copies(monkeypatch)
    got = torch.zeros(2, 16, kv_heads, dim)
    write_kv(got, k, v, slots)
    assert calls == [1] and torch.equal(got, want)


def test_separate_k_and_v_are_written_in_two_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch reference path (RoPE returns a new k): exactly the two plain copies."""
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([1, 7, 4])
    calls = _count_index_copies(monkeypatch)
    got = torch.zeros(2, 8, 2, 8)
    write_kv(got, k, v, slots)
    assert calls == [0, 0]
    assert torch.equal(got[0, slots], k) and torch.equal(got[1, slots], v)
    assert adjacent_pair(k, v[:, :1]) is None and adjacent_pair(v, k) is None


def test_the_profiling_forward_runs_at_the_step_token_budget(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA measurement's arithmetic and its forward, with the two CUDA calls faked."""
    from inlinelm.gpu import kv_cache
    from inlinelm.gpu.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=2, max_num_batched_tokens=40)
    runner = ModelRunner(config, tiny_model_dir)
    calls: list[int] = []
    forward = runner.model.forward

    def counted(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(len(input_ids))
        logits: torch.Tensor = forward(input_ids, *args)
        calls.append(len(logits))
        return logits

    def peak(device: torch.device, run: Any) -> int:
        run()
        return 7 * MiB

    sampler = runner.sampler
    sampled: list[tuple[int, ...]] = []

    def sampling(logits: torch.Tensor, meta: Any) -> Any:
        sampled.append(tuple(logits.shape))
        assert meta.max_num_logprobs == config.max_logprobs  # the costliest sampling
        return sampler(logits, meta)

    def profile(options: EngineConfig, free_at_start: int | None) -> GpuMemoryUse | None:
        return kv_cache.profile_gpu_memory(
            options,
            runner.model_config,
            runner.max_model_len,
            runner.dtype,
            runner.device,
            free_at_start,
            forward=runner._dummy_forward,
            sample=sampling,
        )

    monkeypatch.setattr(runner.model, "forward", counted)
    monkeypatch.setattr(kv_cache, "peak_memory_of", peak)
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: 900 * MiB)
    assert profile(config, None) is None
    use = profile(config, 1000 * MiB)
    assert use is not None
    assert (use.free_at_start, use.used, use.peak_activations) == (1000 * MiB, 100 * MiB, 7 * MiB)
    assert calls == [40, 2]  # one sequence of the whole budget, logits for max_num_seqs rows
    assert sampled == [(2, runner.model_config.vocab_size)]  # sampler temporaries counted
    assert profile(config.with_options(num_kv_blocks=8), 1000 * MiB) is None
    runner.close()


@pytest.mark.skipif(cpu_extension() is None, reason="block-quantized weights need the extension")
@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype", "expected"),
    [
        ("int8", "auto", torch.float16),
        ("none", "auto", torch.float32),
        ("int8", "float32", torch.float32),
        ("none", "float16", torch.float16),
    ],
)
def test_the_cache_dtype_is_float16_for_block_weights_unless_told(
    tiny_model_dir: Path, quantization: str, kv_cache_dtype: str, expected: torch.dtype
) -> None:
    """``kv_cache_dtype="auto"`` keeps a block-quantized model's cache in float16 and a
    float model's in its dtype; a given dtype is kept; a byte budget holds blocks of the
    cache's own size (float16: twice as many)."""
    config = EngineConfig(
        model=str(tiny_model_dir),
        quantization=quantization,  # type: ignore[arg-type]
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        kv_cache_bytes="4MiB",
        num_threads=1,
    )
    runner = ModelRunner(config, tiny_model_dir)
    try:
        cfg = read_model_config(tiny_model_dir)
        assert {cache.dtype for cache in runner.kv_caches} == {expected}
        assert runner.num_kv_blocks == 4 * MiB // bytes_per_block(cfg, 16, expected)
    finally:
        runner.close()


def test_the_cache_dtype_is_a_cpu_option() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, float16"):
        EngineConfig(kv_cache_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="CPU option") as info:
        EngineConfig(device="cuda", kv_cache_dtype="float16")
    assert info.value.option == "kv_cache_dtype"
