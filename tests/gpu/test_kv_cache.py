"""KV-cache sizing: the GPU budget arithmetic on plain numbers, and the spec it feeds; the
K/V write into the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.kv_cache import (
    DEFAULT_KV_CACHE_BYTES_CAP,
    GpuMemoryUse,
    adjacent_pair,
    bytes_per_block,
    gpu_kv_cache_bytes,
    kv_cache_spec,
    write_kv,
)
from inlinelm.gpu.model_config import ModelConfig

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
    cfg = ModelConfig.from_folder(tiny_model_dir)
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
    cfg = ModelConfig.from_folder(tiny_model_dir)
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
    cfg = ModelConfig.from_folder(tiny_model_dir)
    use = GpuMemoryUse(free_at_start=4 * GiB, used=1 * GiB, peak_activations=0)
    blocks = EngineConfig(device="cuda", num_kv_blocks=77)
    assert kv_cache_spec(blocks, cfg, 2048, torch.bfloat16, use).num_blocks == 77
    budget = EngineConfig(device="cuda", kv_cache_bytes=64 * MiB)
    per_block = bytes_per_block(cfg, 16, torch.bfloat16)
    assert kv_cache_spec(budget, cfg, 2048, torch.bfloat16, use).num_blocks == 64 * MiB // per_block


def test_cpu_default_holds_every_sequence_at_full_length_up_to_a_cap(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_folder(tiny_model_dir)
    per_block = bytes_per_block(cfg, 16, torch.float32)
    small = kv_cache_spec(EngineConfig(max_num_seqs=4), cfg, 160, torch.float32)
    assert small.num_blocks == 4 * 10
    huge = kv_cache_spec(EngineConfig(max_num_seqs=10**6), cfg, 2048, torch.float32)
    assert huge.num_blocks == DEFAULT_KV_CACHE_BYTES_CAP // per_block


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
