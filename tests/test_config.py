"""Engine options: the dtype ``auto`` resolution, the checks of every option (``ConfigError``,
with a "did you mean" for a misspelt name), and the sampling defaults' order."""

from __future__ import annotations

import pytest

from inlinelm import Engine
from inlinelm.config import DEFAULT_CUDA_GRAPH_MEMORY_BYTES, FALLBACK_SAMPLING, EngineConfig
from inlinelm.errors import ConfigError, RequestError


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("cpu", "auto", "float32"),
        ("cuda", "auto", "bfloat16"),
        ("cuda:1", "auto", "bfloat16"),
        ("cpu", "bfloat16", "bfloat16"),
        ("cuda", "float32", "float32"),
        ("cuda", "float16", "float16"),
    ],
)
def test_model_dtype_resolves_auto_by_device(device: str, dtype: str, expected: str) -> None:
    assert EngineConfig(device=device, dtype=dtype).model_dtype == expected  # type: ignore[arg-type]


def test_defaults_are_auto_and_a_graph_reserve() -> None:
    config = EngineConfig()
    assert (config.dtype, config.attention_backend) == ("auto", "auto")
    assert config.cuda_graph_memory_bytes == DEFAULT_CUDA_GRAPH_MEMORY_BYTES


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("dtype", "float64"),
        ("attention_backend", "triton"),
        ("cuda_graph_memory_bytes", -1),
        ("cuda_graph_memory_bytes", 1.5),
        ("max_num_seqs", 0),
        ("device", "tpu"),
        ("device", "cuda:x"),
        ("default_temperature", -1.0),
        ("default_max_tokens", 0),
        ("default_top_p", 0.0),
    ],
)
def test_bad_option_values_are_config_errors_naming_the_option(option: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig().with_options(**{option: value})
    assert info.value.option == option
    assert not isinstance(info.value, RequestError), "a bad option is not a bad request"
    assert isinstance(info.value, ValueError)


def test_device_tpu_says_which_devices_exist() -> None:
    with pytest.raises(ConfigError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        Engine(device="tpu")


def test_an_unknown_option_suggests_the_closest_name() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'\?"
    ):
        Engine(max_num_seq=4)
    with pytest.raises(ConfigError, match=r"unknown engine option 'xyzzy'$") as info:
        EngineConfig().with_options(xyzzy=1)
    assert info.value.option == "xyzzy"


def test_sampling_defaults_take_options_then_the_model_then_the_fallback() -> None:
    model = {"temperature": 0.2, "max_tokens": 300, "top_k": 20}
    assert EngineConfig().sampling_defaults({}) == dict(FALLBACK_SAMPLING)
    assert EngineConfig().sampling_defaults(model) == {**FALLBACK_SAMPLING, **model}
    config = EngineConfig(default_temperature=0.0, default_max_tokens=64)
    assert config.sampling_defaults(model) == {
        **FALLBACK_SAMPLING,
        **model,
        "temperature": 0.0,
        "max_tokens": 64,
    }
