"""The up-front memory estimate: it matches what the model really holds, and the refusal
judges the device and the host apart and blames the config field or the engine option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError, ModelLoadError
from inlinelm.gpu.attention import TorchAttention
from inlinelm.gpu.llama import LlamaForCausalLM
from inlinelm.gpu.model_config import ModelConfig, parse_config
from inlinelm.gpu.model_memory import (
    MemoryPart,
    check_fits,
    format_bytes,
    host_memory_available,
    memory_parts,
)

TINY: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
CONFIG_PATH = Path("model/config.json")


def _config(**changes: Any) -> ModelConfig:
    return parse_config({**TINY, **changes}, str(CONFIG_PATH))


def _parts(cfg: ModelConfig, **options: Any) -> dict[str, MemoryPart]:
    config = EngineConfig(max_num_seqs=4, **options)
    parts = memory_parts(config, cfg, cfg.max_position_embeddings, torch.float32)
    return {p.what.partition(":")[0]: p for p in parts}


@pytest.mark.parametrize("variant", [{}, {"model_type": "qwen2", "tie_word_embeddings": False}])
def test_the_estimate_is_what_the_model_holds(variant: dict[str, Any]) -> None:
    cfg = _config(**variant)
    with torch.device("meta"):
        backend = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        model = LlamaForCausalLM(cfg, backend, max_positions=cfg.max_position_embeddings)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rotary = model.rotary.cos_sin_cache
    parts = _parts(cfg)
    assert parts["embedding and LM head"].num_bytes + parts["decoder layers"].num_bytes == weights
    assert parts["rotary table"].num_bytes == rotary.numel() * rotary.element_size()


def _need(parts: list[MemoryPart], on_device: bool) -> int:
    return sum(p.num_bytes for p in parts if p.on_device == on_device)


def test_cuda_weights_are_judged_against_the_device() -> None:
    parts = list(_parts(_config(vocab_size=10**6)).values())
    device, host = _need(parts, True), _need(parts, False)
    check_fits(parts, device_free=device, host_free=host, config_path=CONFIG_PATH)
    with pytest.raises(ModelLoadError, match="free GPU memory") as info:
        check_fits(parts, device_free=device - 1, host_free=10**15, config_path=CONFIG_PATH)
    assert (info.value.path, info.value.field) == (str(CONFIG_PATH), "vocab_size")
    with pytest.raises(ModelLoadError, match="of memory available"):
        check_fits(parts, device_free=10**15, host_free=host - 1, config_path=CONFIG_PATH)


def test_a_cpu_model_is_judged_against_the_host_as_a_whole() -> None:
    parts = list(_parts(_config()).values())
    total = sum(p.num_bytes for p in parts)
    check_fits(parts, device_free=None, host_free=total, config_path=CONFIG_PATH)
    with pytest.raises(ModelLoadError, match="of memory available"):
        check_fits(parts, device_free=None, host_free=total - 1, config_path=CONFIG_PATH)


def test_a_context_too_long_blames_whoever_chose_it() -> None:
    cfg = _config(max_position_embeddings=10**9)
    parts = list(_parts(cfg).values())
    with pytest.raises(ModelLoadError, match="max_model_len") as info:
        check_fits(parts, device_free=None, host_free=2**30, config_path=CONFIG_PATH)
    assert info.value.field == "max_position_embeddings"
    parts = list(_parts(cfg, max_model_len=10**9).values())
    with pytest.raises(ConfigError) as config_error:
        check_fits(parts, device_free=None, host_free=2**30, config_path=CONFIG_PATH)
    assert config_error.value.option == "max_model_len"


def test_a_kv_cache_option_that_cannot_fit_is_a_config_error(tiny_model_dir: Path) -> None:
    engine = Engine(model=str(tiny_model_dir), num_threads=1, kv_cache_bytes=2**60)
    try:
        with pytest.raises(ConfigError, match="KV cache") as info:
            engine.start_sync()
    finally:
        engine.close()
    assert info.value.option == "kv_cache_bytes"


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads Linux's /proc/meminfo")
def test_host_memory_is_read_on_linux() -> None:
    available = host_memory_available()
    assert available is not None and available > 0


def test_format_bytes() -> None:
    assert format_bytes(512) == "512.0 B"
    assert format_bytes(3 * 2**29) == "1.5 GiB"
    assert format_bytes(2**42) == "4.0 TiB"
