"""KV-cache sizing: the GPU budget arithmetic on plain numbers, and the spec it feeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.kv_cache import (
    DEFAULT_KV_CACHE_BYTES_CAP,
    GpuMemoryUse,
    bytes_per_block,
    gpu_kv_cache_bytes,
    kv_cache_spec,
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
