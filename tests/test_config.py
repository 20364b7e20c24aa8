"""Engine options: the dtype ``auto`` resolution and the checks of the device options."""

from __future__ import annotations

import pytest

from inlinelm.config import DEFAULT_CUDA_GRAPH_MEMORY_BYTES, EngineConfig
from inlinelm.errors import RequestError


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
    ],
)
def test_bad_device_options_are_refused(option: str, value: object) -> None:
    with pytest.raises(RequestError) as info:
        EngineConfig().with_options(**{option: value})
    assert info.value.param == option
