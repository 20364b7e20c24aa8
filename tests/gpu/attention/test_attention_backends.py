"""Choosing the attention backend, and the FlashInfer backend against the torch one: on the
CPU through the stand-in ``flashinfer`` (tests/gpu/fakes.py), on CUDA for real."""

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
from inlinelm.gpu.attention.metadata import AttentionMetadata, LayerAttention
from inlinelm.gpu.attention.select import make_attention_backend, select_attention_backend
from inlinelm.gpu.attention.torch_backend import TorchAttention
from tests.gpu.attention.kind_steps import eager_results, graph_results
from tests.gpu.attention.page_table_oracle import PageTableAttention
from tests.gpu.paged_steps import Shape, make_step, plain_layer, run_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16 = torch.bfloat16
PLAIN8 = LayerAttention(8**-0.5)


def model_kinds(head_dim: int) -> dict[str, list[LayerAttention]]:
    """The attention kinds of each layer of a few models: one windowed, soft-capped or
    scaled kind (Mistral, Gemma 2's cap, Gemma's ``query_pre_attn_scalar``), and Gemma 2's
    sliding and global layers alternating (two kinds, three layers). Windows of 5 keys and
    a cap of 0.5 on products of about 1 change every test step's output."""
    plain = head_dim**-0.5
    return {
        "window": [LayerAttention(plain, sliding_window=5)],
        "softcap": [LayerAttention(plain, softcap=0.5)],
        "scale": [LayerAttention(0.6)],
        "gemma2": [
            LayerAttention(0.6, sliding_window=5, softcap=0.5),
            LayerAttention(0.6, softcap=0.5),
            LayerAttention(0.6, sliding_window=5, softcap=0.5),
        ],
    }


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
    backend = make_attention_backend("auto", CPU, 4, 2, 8, torch.float32, [PLAIN8])
    assert isinstance(backend, TorchAttention)


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

# (cached prefix, new tokens) per request: a mixed step and a decode step whose contexts
# cross the windows of 5 (and page boundaries at 16)
CPU_STEPS = {
    "prefill": [(0, 7), (20, 1), (16, 5), (3, 1)],
    "decode": [(0, 1), (15, 1), (40, 1)],
}


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("planned", sorted(CPU_STEPS))
def test_flashinfer_glue_plans_once_and_matches_torch(planned: str, block_size: int) -> None:
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(6, 2, 8, torch.float32, CPU, [PLAIN8, PLAIN8])
    assert backend.kinds == (PLAIN8,)
    assert backend._prefill[PLAIN8].workspace is backend._decode[PLAIN8].workspace
    layers = [
        make_step(Shape(block_size, 6, 2, 8), CPU_STEPS[planned], 0, data_seed=i) for i in (0, 1)
    ]
    meta = layers[0].metadata(CPU)
    backend.prepare(meta, block_size)
    for step in layers:
        expected, expected_cache = run_backend(TorchAttention(6, 2, 8), step, block_size)
        cache = step.kv_cache.clone()
        out = backend.forward(step.q, step.k, step.v, cache, meta, plain_layer(step.q))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, expected_cache)
    chosen, other = _wrappers(backend, planned)
    assert (chosen[PLAIN8].plans, other[PLAIN8].plans) == (1, 0)


def _wrappers(backend: Any, planned: str) -> tuple[dict[LayerAttention, Any], ...]:
    """The backend's wrappers of the sort a ``planned`` step runs, then the other sort."""
    if planned == "prefill":
        return backend._prefill, backend._decode
    return backend._decode, backend._prefill


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize("head_dim", [8, 256])
@pytest.mark.parametrize("planned", sorted(CPU_STEPS))
@pytest.mark.parametrize("model", sorted(model_kinds(8)))
def test_flashinfer_glue_plans_each_kind_once_per_step_and_matches_torch(
    model: str, planned: str, head_dim: int
) -> None:
    """Each layer runs its kind's wrapper, every kind planned once for the step; the
    window, soft cap and scale reach FlashInfer in its terms (the stand-in applies them
    as FlashInfer's kernels do) and equal the torch backend's."""
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    kinds = model_kinds(head_dim)[model]
    shape = Shape(16, 6, 2, head_dim)
    backend = FlashInferAttention(6, 2, head_dim, torch.float32, CPU, kinds)
    assert backend.kinds == tuple(dict.fromkeys(kinds))
    steps = [make_step(shape, CPU_STEPS[planned], 0, data_seed=i) for i in range(len(kinds))]
    meta = steps[0].metadata(CPU)
    backend.prepare(meta, shape.block_size)
    for step, kind in zip(steps, kinds, strict=True):
        torch_attention = TorchAttention(6, 2, head_dim)
        expected, expected_cache = run_backend(torch_attention, step, 16, layer=kind)
        plain, _ = run_backend(torch_attention, step, 16)
        cache = step.kv_cache.clone()
        out = backend.forward(step.q, step.k, step.v, cache, meta, kind)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, expected_cache)
        assert not torch.allclose(out, plain, atol=1e-3)  # the kind changed the result
    chosen, other = _wrappers(backend, planned)
    assert {kind: w.plans for kind, w in chosen.items()} == dict.fromkeys(backend.kinds, 1)
    assert all(w.plans == 0 for w in other.values())


def test_layer_plan_options_follow_flashinfers_conventions() -> None:
    """A window of w keys (the query's own included) is FlashInfer's window_left w - 1;
    none is -1; no cap is 0.0; the scale goes as sm_scale (plain floats, plain ints)."""
    from inlinelm.gpu.attention.flashinfer_backend import layer_plan_options

    gemma = layer_plan_options(LayerAttention(144**-0.5, sliding_window=4096, softcap=50))
    assert gemma == {"sm_scale": 144**-0.5, "window_left": 4095, "logits_soft_cap": 50.0}
    assert isinstance(gemma["logits_soft_cap"], float)
    plain = layer_plan_options(LayerAttention(0.125))
    assert plain == {"sm_scale": 0.125, "window_left": -1, "logits_soft_cap": 0.0}
    assert layer_plan_options(LayerAttention(0.125, sliding_window=1))["window_left"] == 0


@pytest.mark.usefixtures("fake_flashinfer")
def test_flashinfer_refuses_no_kinds_bad_windows_and_caps_and_kinds_it_was_not_built_for() -> None:
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    with pytest.raises(ValueError, match="at least one layer"):
        FlashInferAttention(6, 2, 8, torch.float32, CPU, [])
    with pytest.raises(ValueError, match="at least one key"):
        FlashInferAttention(6, 2, 8, torch.float32, CPU, [LayerAttention(0.3, sliding_window=0)])
    with pytest.raises(ValueError, match="above 0"):
        FlashInferAttention(6, 2, 8, torch.float32, CPU, [LayerAttention(0.3, softcap=0.0)])
    backend = FlashInferAttention(6, 2, 8, torch.float32, CPU, [PLAIN8])
    step = make_step(Shape(16, 6, 2, 8), CPU_STEPS["decode"], 0)
    meta = step.metadata(CPU)
    backend.prepare(meta, 16)
    cache = step.kv_cache.clone()
    with pytest.raises(ValueError, match="no FlashInfer plan for"):
        backend.forward(step.q, step.k, step.v, cache, meta, LayerAttention(8**-0.5, 5))
    assert torch.equal(cache, step.kv_cache)  # refused before the K/V write


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

    kinds = model_kinds(8)["gemma2"]
    backend = FlashInferAttention(6, 2, 8, torch.float32, CPU, kinds)
    attention = backend.make_graph_attention(12, 128, 16, CPU)
    assert attention.max_batch_size == 12 and attention.indices.shape == (12 * 8,)
    attention.init_capture_graph([1, 2, 4, 8, 12])
    assert sorted(attention.wrappers) == [1, 2, 4, 8, 12]
    for size, by_kind in attention.wrappers.items():
        assert list(by_kind) == list(backend.kinds)
        for kind, wrapper in by_kind.items():
            options = wrapper.options
            assert options["use_cuda_graph"] is True and wrapper.workspace is backend._workspace
            assert options["paged_kv_indices_buffer"] is attention.indices
            assert options["paged_kv_indptr_buffer"].shape == (size + 1,)
            assert options["paged_kv_last_page_len_buffer"].shape == (size,)
            # one int workspace per kind, whatever the size
            assert wrapper.int_workspace is attention.int_workspaces[kind]
    first, second = attention.int_workspaces.values()
    assert first.data_ptr() != second.data_ptr()
    meta = attention.prepare_for_capture(4, torch.zeros(4, dtype=torch.int64))
    assert isinstance(meta.plan, _FlashInferPlan) and meta.plan.wrappers is attention.wrappers[4]
    assert meta.plan.wrapper(kinds[1]) is attention.wrappers[4][kinds[1]]
    assert meta.plan.table.is_decode and meta.max_query_len == 1
    attention.close()
    assert attention.wrappers == {} and attention.int_workspaces == {}


GRAPH_STEPS = ([(0, 1), (15, 1), (40, 1), (7, 1)], [(30, 1), (2, 1), (16, 1), (55, 1)])
"""Two decode steps of four rows replayed through one size's static buffers."""


@pytest.mark.usefixtures("fake_flashinfer")
def test_the_flashinfer_graph_attention_plans_every_kind_before_a_replay_and_matches_torch() -> (
    None
):
    """Gemma 2's two kinds through the graphed decode: the metadata made once (at the
    capture) picks each layer's wrapper; each replay's plan plans every kind of that size,
    and no other size; the results equal the torch backend's for both steps."""
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    kinds = model_kinds(8)["gemma2"][:2]
    backend = FlashInferAttention(6, 2, 8, torch.float32, CPU, kinds)
    attention = backend.make_graph_attention(4, 128, 16, CPU)
    attention.init_capture_graph([1, 2, 4])
    steps = [make_step(Shape(16, 6, 2, 8), requests, i) for i, requests in enumerate(GRAPH_STEPS)]
    results = graph_results(backend, attention, kinds, steps, capture=False)
    assert [kind for kind, _, _ in results] == kinds * len(steps)
    for _, out, expected in results:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # one plan at the capture, one before each replay, of every kind of size 4 only
    planned = {size: [w.plans for w in ws.values()] for size, ws in attention.wrappers.items()}
    assert planned == {1: [0, 0], 2: [0, 0], 4: [3, 3]}
    attention.close()


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
    backend = FlashInferAttention(*heads, torch.bfloat16, CUDA, [LayerAttention(heads[2] ** -0.5)])
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

    kinds = [LayerAttention(64**-0.5), LayerAttention(64**-0.5, sliding_window=8)]
    backend = make_attention_backend("auto", CUDA, 9, 3, 64, torch.bfloat16, kinds)
    assert isinstance(backend, FlashInferAttention) and backend.kinds == tuple(kinds)


CUDA_FAMILY_SHAPES = {
    # Gemma 2 2B's heads (two query heads per KV head: the CUDA-core decode kernel), both
    # kinds soft-capped, at Gemma 2 27B's query scale (query_pre_attn_scalar 144)
    "gemma2": (
        8,
        4,
        256,
        [LayerAttention(144**-0.5, 8, 2.0), LayerAttention(144**-0.5, None, 2.0)],
    ),
    # Gemma 3 1B's (four: decode runs on the prefill kernel), no cap
    "gemma3": (4, 1, 256, [LayerAttention(256**-0.5, 8), LayerAttention(256**-0.5)]),
}
"""The GPU check's family shapes (benchmarks/gpu_kernels.py FAMILY_SHAPES, whose modules it
builds ahead; tests/test_gpu_check.py holds the two equal)."""


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", sorted(CUDA_FAMILY_SHAPES))
@pytest.mark.parametrize("step_name", sorted(CUDA_STEPS))
def test_flashinfer_layer_kinds_equal_torch_backend_on_cuda(
    step_name: str, shape_name: str
) -> None:
    """bf16 FlashInfer with a window, a soft cap and a custom scale per layer kind (one
    plan per kind; three layers, two kinds) against the torch backend in float32."""
    pytest.importorskip("flashinfer")
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    *heads, kinds = CUDA_FAMILY_SHAPES[shape_name]
    layers = [*kinds, kinds[0]]
    backend = FlashInferAttention(*heads, BF16, CUDA, layers)
    shape = Shape(16, *heads)
    steps = [
        make_step(shape, CUDA_STEPS[step_name], 0, data_seed=i, dtype=BF16, device=CUDA)
        for i in range(len(layers))
    ]
    for _, out, expected in eager_results(backend, layers, steps, 16):
        assert out.shape == expected.shape and out.dtype == BF16
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", sorted(CUDA_FAMILY_SHAPES))
def test_flashinfer_graph_attention_with_two_kinds_replays_on_cuda(shape_name: str) -> None:
    """One CUDA graph of both kinds' decode, captured once, replayed for two steps, each
    planned (every kind) before its replay: equal to the torch backend in float32."""
    pytest.importorskip("flashinfer")
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    *heads, kinds = CUDA_FAMILY_SHAPES[shape_name]
    backend = FlashInferAttention(*heads, BF16, CUDA, kinds)
    attention = backend.make_graph_attention(4, 256, 16, CUDA)
    attention.init_capture_graph([1, 2, 4])
    shape = Shape(16, *heads)
    steps = [
        make_step(shape, requests, i, dtype=BF16, device=CUDA)
        for i, requests in enumerate(GRAPH_STEPS)
    ]
    for _, out, expected in graph_results(backend, attention, kinds, steps, capture=True):
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    attention.close()


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
        plan=_FlashInferPlan(table, {plain_layer(q): wrapper}),
    )
    cache = torch.zeros(2, 4 * page, kv_heads, dim)
    backend.forward(q, k, torch.randn_like(k), cache, meta, plain_layer(q))
    (got,) = wrapper.queries
    assert torch.equal(got, q)
    if decode:
        assert got is q and not q.is_contiguous()
    else:
        assert got.is_contiguous()
