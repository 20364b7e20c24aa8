"""Engine options: the dtype ``auto`` resolution, the checks of every option (``ConfigError``,
with a "did you mean" for a misspelt name), sizes in text, and the sampling defaults' order."""

from __future__ import annotations

import pytest

from inlinelm import Engine
from inlinelm.config import (
    DEFAULT_CUDA_GRAPH_MEMORY_BYTES,
    FALLBACK_SAMPLING,
    EngineConfig,
    parse_byte_size,
)
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
        ("kv_cache_bytes", [1]),
        ("kv_cache_bytes", -1),
        ("kv_cache_bytes", 0),
        ("kv_cache_bytes", "lots"),
        ("kv_cache_bytes", 1.5e9),
        ("kv_cache_bytes", True),
        ("num_threads", "2"),
        ("num_threads", 0),
        ("num_threads", True),
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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 * 2**20),  # IEC: powers of 1024
        ("1.5GiB", 3 * 2**29),
        ("64Ki", 64 * 1024),
        ("512MB", 512 * 10**6),  # SI: powers of 1000
        ("2GB", 2 * 10**9),
        ("2G", 2 * 2**30),  # a bare letter: 1024, as Docker and -Xmx read it
        ("2g", 2 * 2**30),
        (" 300 mib ", 300 * 2**20),
        ("4096", 4096),
        ("4096B", 4096),
        (1024, 1024),
    ],
)
def test_sizes_are_read_in_iec_si_and_bare_units(text: str | int, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("value", ["lots", "", "MiB", "1e9", "-5MiB", "0.4", "2 GiBs", 2.0, None])
def test_a_size_that_is_not_one_says_what_a_size_looks_like(value: object) -> None:
    with pytest.raises(ValueError, match="positive number of bytes"):
        parse_byte_size(value)


def test_a_kv_cache_size_in_text_is_kept_as_given_and_read_as_bytes() -> None:
    config = EngineConfig(kv_cache_bytes="256MiB")
    assert config.kv_cache_bytes == "256MiB" and config.kv_cache_budget == 256 * 2**20
    assert EngineConfig(kv_cache_bytes=4096).kv_cache_budget == 4096
    assert EngineConfig().kv_cache_budget is None
    with pytest.raises(ConfigError, match="kv_cache_bytes: expected a positive number") as info:
        Engine(kv_cache_bytes="lots")
    assert info.value.option == "kv_cache_bytes"
