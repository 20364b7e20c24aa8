"""Errors a user understands: a misspelt sampling field gets a "did you mean", a device
this torch cannot use names the ones it can, and a KV budget too small for one
``max_model_len`` sequence names the options to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inlinelm import ConfigError, Engine, RequestError, SamplingParams
from inlinelm.config import EngineConfig
from inlinelm.gpu.kv_cache import kv_cache_spec
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.runtime.loader import check_device
from tests.runtime.helpers import echo_engine, run


def test_a_misspelt_sampling_field_suggests_the_right_one() -> None:
    with pytest.raises(RequestError, match="'temprature'; did you mean 'temperature'") as info:
        SamplingParams().with_overrides(temprature=0.5)
    assert info.value.param == "temprature"

    async def main() -> None:
        async with echo_engine() as engine:
            with pytest.raises(RequestError, match="did you mean 'max_tokens'"):
                engine.stream("hello", max_token=5)

    run(main())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_on_a_cpu_only_torch_says_what_is_available(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"device='cuda'.*available: cpu$") as info:
        check_device("cuda")
    assert info.value.option == "device"
    engine = Engine(model=str(tiny_model_dir), device="cuda:1")
    try:
        with pytest.raises(ConfigError, match=r"device='cuda:1'.*available: cpu"):
            engine.start_sync()
    finally:
        engine.close()


def test_a_kv_budget_below_one_sequence_names_the_options(tiny_model_dir: Path) -> None:
    cfg = read_model_config(tiny_model_dir)
    config = EngineConfig(kv_cache_bytes=64 * 1024)
    with pytest.raises(ConfigError) as info:
        kv_cache_spec(config, cfg, max_model_len=2048, dtype=torch.float32)
    message = str(info.value)
    for option in ("max_model_len", "kv_cache_bytes", "num_kv_blocks", "gpu_memory_utilization"):
        assert option in message
    assert "max_model_len=2048" in message and info.value.option == "max_model_len"
    # The same budget holds a shorter context.
    assert kv_cache_spec(config, cfg, max_model_len=16, dtype=torch.float32).num_blocks >= 1
