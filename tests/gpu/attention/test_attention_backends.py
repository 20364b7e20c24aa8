"""Choosing the attention backend, and the FlashInfer backend against the torch one on CUDA."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from inlinelm.errors import ConfigError
from inlinelm.gpu.attention import select as attention_backends
from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.attention.select import make_attention_backend, select_attention_backend
from inlinelm.gpu.attention.torch_backend import TorchAttention
from tests.gpu.attention.page_table_oracle import PageTableAttention
from tests.gpu.paged_steps import Shape, make_step, plain_layer, run_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16 = torch.bfloat16


@pytest.fixture
def without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises


@pytest.fixture
def with_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))


def test_torch_is_taken_as_asked_on_any_device() -> None:
    assert select_attention_backend("torch", CPU, BF16, head_dim=64) == "torch"
    assert select_attention_backend("torch", CUDA, BF16, head_dim=64) == "torch"


def test_auto_on_cpu_is_torch_without_trying_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> str | None:
        raise AssertionError("flashinfer imported off CUDA")

    monkeypatch.setattr(attention_backends, "_flashinfer_import_error", fail)
    assert select_attention_backend("auto", CPU, BF16, head_dim=64) == "torch"
    assert isinstance(make_attention_backend("auto", CPU, 4, 2, 8, torch.float32), TorchAttention)


@pytest.mark.usefixtures("with_flashinfer")
def test_auto_on_cuda_is_flashinfer_when_it_imports() -> None:
    assert select_attention_backend("auto", CUDA, BF16, head_dim=64) == "flashinfer"
    assert select_attention_backend("flashinfer", CUDA, BF16, head_dim=64) == "flashinfer"


@pytest.mark.usefixtures("with_flashinfer")
def test_float32_runs_the_torch_backend() -> None:
    assert select_attention_backend("auto", CUDA, torch.float32, head_dim=64) == "torch"
    with pytest.raises(ConfigError, match="needs dtype bfloat16 or float16"):
        select_attention_backend("flashinfer", CUDA, torch.float32, head_dim=64)


@pytest.mark.usefixtures("with_flashinfer")
def test_a_head_dim_flashinfer_lacks_runs_the_torch_backend() -> None:
    assert select_attention_backend("auto", CUDA, BF16, head_dim=16) == "torch"
    with pytest.raises(ConfigError, match="needs a head dim") as info:
        select_attention_backend("flashinfer", CUDA, BF16, head_dim=96)
    assert info.value.option == "attention_backend"


@pytest.mark.usefixtures("without_flashinfer")
def test_auto_on_cuda_falls_back_to_torch_without_flashinfer() -> None:
    assert select_attention_backend("auto", CUDA, BF16, head_dim=64) == "torch"


@pytest.mark.usefixtures("without_flashinfer")
def test_flashinfer_without_the_package_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot import flashinfer") as info:
        select_attention_backend("flashinfer", CUDA, BF16, head_dim=64)
    assert info.value.option == "attention_backend"


@pytest.mark.usefixtures("with_flashinfer")
def test_flashinfer_off_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device") as info:
        select_attention_backend("flashinfer", CPU, BF16, head_dim=64)
    assert info.value.option == "attention_backend"


def test_unknown_backend_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="auto, flashinfer, torch"):
        select_attention_backend("flash", CPU, BF16, head_dim=64)


def test_importing_inlinelm_and_the_backends_never_imports_flashinfer() -> None:
    code = (
        "import sys, inlinelm, inlinelm.gpu.attention.flashinfer_backend, inlinelm.gpu.attention.select;"
        "assert 'flashinfer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the FlashInfer glue on the CPU, through a stand-in for its two wrappers ----------------


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize(
    ("requests", "planned"),
    [([(0, 7), (20, 1), (16, 5), (3, 1)], "prefill"), ([(0, 1), (15, 1), (40, 1)], "decode")],
)
def test_flashinfer_glue_plans_once_and_matches_torch(
    requests: list[tuple[int, int]], planned: str, block_size: int
) -> None:
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(6, 2, 8, torch.float32, CPU)
    assert backend._prefill.workspace is backend._decode.workspace
    layers = [make_step(Shape(block_size, 6, 2, 8), requests, 0, data_seed=i) for i in (0, 1)]
    meta = layers[0].metadata(CPU)
    backend.prepare(meta, block_size)
    for step in layers:
        expected, expected_cache = run_backend(TorchAttention(6, 2, 8), step, block_size)
        cache = step.kv_cache.clone()
        out = backend.forward(step.q, step.k, step.v, cache, meta, plain_layer(step.q))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, expected_cache)
    chosen = backend._prefill if planned == "prefill" else backend._decode
    other = backend._decode if planned == "prefill" else backend._prefill
    assert (chosen.plans, other.plans) == (1, 0)


def test_the_torch_graph_attention_caps_its_largest_size_by_the_keys_it_gathers() -> None:
    from inlinelm.gpu.attention.torch_backend import TORCH_GRAPH_MAX_KEYS, TorchGraphAttention

    backend = TorchAttention(6, 2, 8)
    short = backend.make_graph_attention(12, 128, 16, CPU)
    assert isinstance(short, TorchGraphAttention) and short.max_batch_size == 12
    long = backend.make_graph_attention(64, TORCH_GRAPH_MAX_KEYS // 4, 16, CPU)
    assert long.max_batch_size == 4 and long.block_tables.shape == (4, TORCH_GRAPH_MAX_KEYS // 64)


@pytest.mark.usefixtures("fake_flashinfer")
def test_the_flashinfer_graph_attention_has_a_graph_wrapper_per_size_over_shared_buffers() -> None:
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention, _FlashInferPlan

    backend = FlashInferAttention(6, 2, 8, torch.float32, CPU)
    attention = backend.make_graph_attention(12, 128, 16, CPU)
    assert attention.max_batch_size == 12 and attention.indices.shape == (12 * 8,)
    attention.init_capture_graph([1, 2, 4, 8, 12])
    assert sorted(attention.wrappers) == [1, 2, 4, 8, 12]
    for size, wrapper in attention.wrappers.items():
        options = wrapper.options
        assert options["use_cuda_graph"] is True and wrapper.workspace is backend._workspace
        assert options["paged_kv_indices_buffer"] is attention.indices
        assert options["paged_kv_indptr_buffer"].shape == (size + 1,)
        assert options["paged_kv_last_page_len_buffer"].shape == (size,)
    meta = attention.prepare_for_capture(4, torch.zeros(4, dtype=torch.int64))
    assert isinstance(meta.plan, _FlashInferPlan) and meta.plan.wrapper is attention.wrappers[4]
    assert meta.plan.table.is_decode and meta.max_query_len == 1
    attention.close()
    assert attention.wrappers == {}


# -- on the device --------------------------------------------------------------------------

# (cached prefix, new tokens) per request
CUDA_STEPS = {
    "mixed": [(0, 37), (20, 1), (16, 16), (100, 1), (5, 11), (0, 1)],
    "prefix_hits": [(48, 9), (33, 40), (15, 1)],
    "decode": [(n, 1) for n in (0, 15, 16, 17, 31, 200, 1, 63, 64, 1000)],
}
CUDA_SHAPES = {"gqa3": (9, 3, 64), "gqa4": (8, 2, 64)}


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("step_name", sorted(CUDA_STEPS))
def test_page_table_attention_equals_torch_backend_on_cuda(step_name: str, block_size: int) -> None:
    step = make_step(Shape(block_size, 9, 3, 64), CUDA_STEPS[step_name], 0, device=CUDA)
    expected, _ = run_backend(TorchAttention(9, 3, 64), step, block_size)
    out, _ = run_backend(PageTableAttention(9, 3, 64), step, block_size)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", sorted(CUDA_SHAPES))
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("step_name", sorted(CUDA_STEPS))
def test_flashinfer_equals_torch_backend_on_cuda(
    step_name: str, block_size: int, shape_name: str
) -> None:
    pytest.importorskip("flashinfer")
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    heads = CUDA_SHAPES[shape_name]
    shape = Shape(block_size, *heads)
    backend = FlashInferAttention(*heads, torch.bfloat16, CUDA)
    # two layers on one plan: prepare once per step, run per layer
    layers = [
        make_step(
            shape, CUDA_STEPS[step_name], 0, data_seed=layer, dtype=torch.bfloat16, device=CUDA
        )
        for layer in (0, 1)
    ]
    meta = layers[0].metadata(CUDA)
    backend.prepare(meta, block_size)
    for step in layers:
        expected, expected_cache = run_backend(TorchAttention(*heads), step, block_size)
        cache = step.kv_cache.clone()
        out = backend.forward(step.q, step.k, step.v, cache, meta, plain_layer(step.q))
        assert out.shape == expected.shape and out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        assert torch.equal(cache, expected_cache)


@pytest.mark.gpu
def test_auto_picks_flashinfer_on_cuda_when_installed() -> None:
    pytest.importorskip("flashinfer")
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    backend = make_attention_backend("auto", CUDA, 9, 3, 64, torch.bfloat16)
    assert isinstance(backend, FlashInferAttention)


class _RecordingWrapper:
    """Stands in for a FlashInfer wrapper: records the q it is run with."""

    def __init__(self) -> None:
        self.queries: list[torch.Tensor] = []

    def run(self, q: torch.Tensor, pages: Any) -> torch.Tensor:
        self.queries.append(q)
        return torch.zeros_like(q)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_flashinfer_decode_takes_the_strided_q_and_prefill_a_dense_one(decode: bool) -> None:
    """No copy kernel per layer on decode: the head slice of the fused QK goes as it is."""
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention, _FlashInferPlan
    from inlinelm.gpu.attention.page_table import build_page_table

    heads, kv_heads, dim, page = 4, 2, 8, 4
    lens = np.array([1, 1] if decode else [3, 1], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    table = build_page_table(starts, lens + 2, np.array([[0, 1], [2, 3]]), page, CPU)
    wrapper = _RecordingWrapper()
    backend = FlashInferAttention.__new__(FlashInferAttention)
    tokens = int(lens.sum())
    qk = torch.randn(tokens, heads + kv_heads, dim)
    q, k = qk[:, :heads], qk[:, heads:]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(lens + 2),
        block_tables=torch.zeros(2, 1, dtype=torch.int64),
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()) + 2,
        plan=_FlashInferPlan(table, wrapper),
    )
    cache = torch.zeros(2, 4 * page, kv_heads, dim)
    backend.forward(q, k, torch.randn_like(k), cache, meta, plain_layer(q))
    (got,) = wrapper.queries
    assert torch.equal(got, q)
    if decode:
        assert got is q and not q.is_contiguous()
    else:
        assert got.is_contiguous()
