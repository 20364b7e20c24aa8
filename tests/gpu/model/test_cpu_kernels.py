"""The fused float32 CPU kernels (``csrc/cpu_ops.cpp``) against the torch kernels and the
torch attention backend they stand in for, op by op and through whole models.

Each bound is float32's: a kernel's sums run in vector lanes where torch's run in another
order, so a result may move by the rounding of each operation that fed it (``n`` terms of
a sum: n * eps of the sum of their sizes, the worst case). A wrong index, a missed term
or a wrong constant moves it by the size of a term, thousands of times more."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata, LayerAttention
from inlinelm.gpu.attention.select import make_attention_backend
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.model.cpu_extension import cpu_extension, cpu_ops
from inlinelm.gpu.model.kernels import CpuKernels, TorchKernels, make_kernels
from inlinelm.gpu.model.layers.attention import Attention
from inlinelm.gpu.model.layers.mlp import GatedMLP
from inlinelm.gpu.model.layers.norm import RMSNorm
from inlinelm.gpu.model.layers.rotary import RotaryEmbedding
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.rope import RopeConfig
from tests.gpu.attention.test_attention_backends import model_kinds
from tests.gpu.families import make_family_model
from tests.gpu.paged_steps import Shape, make_step, run_backend
from tests.gpu.reference import (
    BLOCK_SIZE,
    PROMPTS,
    PagedGreedyDriver,
    assert_logits_close,
    load_ours,
    rope_rows,
)

pytestmark = pytest.mark.skipif(cpu_extension() is None, reason="the CPU extension did not build")

EPS = torch.finfo(torch.float32).eps
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> Any:
    return cpu_extension()


@pytest.fixture(scope="module")
def fused(ops: Any) -> CpuKernels:
    return CpuKernels(ops)


def test_the_extension_serves_float32_on_a_cpu_only(ops: Any) -> None:
    assert cpu_ops(CPU, torch.float32) is ops
    assert cpu_ops(CPU, torch.bfloat16) is None
    assert cpu_ops(torch.device("cuda"), torch.float32) is None
    assert isinstance(make_kernels("torch", ops), CpuKernels)
    assert type(make_kernels("torch")) is TorchKernels


def test_a_float32_cpu_runner_takes_the_fused_kernels_everywhere(tiny_model_dir: Path) -> None:
    from inlinelm.config import EngineConfig
    from inlinelm.gpu.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16), tiny_model_dir)
    model = runner.model
    assert isinstance(model.kernels, CpuKernels)
    users = [m for m in model.modules() if isinstance(m, RMSNorm | Attention | GatedMLP)]
    assert users and all(m.kernels is model.kernels for m in users)
    assert isinstance(runner.backend, TorchAttention) and runner.backend.cpu_ops is runner.cpu_ops


# -- RMSNorm ---------------------------------------------------------------------------------


def _norm_bound(x: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """The sum of D squares moves by D * eps of itself, its inverse root by half that; the
    scaling adds a few roundings."""
    return (x.shape[-1] / 2 + 4) * EPS * expected.abs() + 1e-30


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("dim", [576, 1, 7, 64, 130])
def test_rms_norm_equals_torch(fused: CpuKernels, dim: int, offset: float) -> None:
    torch.manual_seed(dim)
    x = torch.randn(9, dim) * 3
    weight = torch.randn(dim)
    expected = TorchKernels().rms_norm(x, weight, 1e-6, offset)
    got = fused.rms_norm(x, weight, 1e-6, offset)
    assert (got - expected).abs().le(_norm_bound(x, expected)).all()


def test_rms_norm_reads_strided_rows_and_per_head_views(fused: CpuKernels) -> None:
    """q/k norms run on [T, H, D] views into the fused qkv projection."""
    torch.manual_seed(0)
    qkv = torch.randn(5, (4 + 2 * 2) * 16)
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # rows of stride 128, heads of stride 16
    assert not q.is_contiguous()
    weight = torch.randn(16)
    expected = TorchKernels().rms_norm(q, weight, 1e-5)
    got = fused.rms_norm(q, weight, 1e-5)
    assert got.shape == q.shape
    assert (got - expected).abs().le(_norm_bound(q, expected)).all()
    rows = qkv[:, 32:96]  # 2D rows at a stride
    expected = TorchKernels().rms_norm(rows, torch.ones(64), 1e-5)
    assert (
        (fused.rms_norm(rows, torch.ones(64), 1e-5) - expected)
        .abs()
        .le(_norm_bound(rows, expected))
        .all()
    )


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_add_rms_norm_updates_both_in_place_like_torch(fused: CpuKernels, offset: float) -> None:
    torch.manual_seed(1)
    x, residual, weight = torch.randn(6, 576), torch.randn(6, 576), torch.randn(576)
    expected, expected_residual = TorchKernels().add_rms_norm(
        x.clone(), residual.clone(), weight, 1e-6, offset
    )
    got, got_residual = fused.add_rms_norm(x, residual, weight, 1e-6, offset)
    assert got is x and got_residual is residual
    assert torch.equal(got_residual, expected_residual)  # one addition: exact
    assert (got - expected).abs().le(_norm_bound(x, expected)).all()


# -- RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("partial", [1.0, 0.5, 0.25], ids=["whole", "half", "quarter"])
def test_rope_rotates_a_strided_qk_view_in_place_like_torch(
    fused: CpuKernels, partial: float
) -> None:
    head_dim, heads, kv_heads, tokens = 64, 4, 2, 7
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), int(head_dim * partial), 64)
    positions = torch.tensor([0, 1, 2, 5, 9, 33, 63])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    values = qkv[:, (heads + kv_heads) * head_dim :].clone()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    torch_kernels = TorchKernels()
    expected = torch_kernels.apply_rope(
        qk.clone(), heads, torch_kernels.rope_inputs(rotary.cos_sin_cache, positions, torch.float32)
    )
    got = fused.apply_rope(
        qk, heads, fused.rope_inputs(rotary.cos_sin_cache, positions, torch.float32)
    )
    assert got is qk
    # x1 * cos - x2 * sin: two products and a difference, each rounded once
    bound = 4 * EPS * qk.abs().amax(-1, keepdim=True)
    assert (got - expected).abs().le(bound).all()
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], values)  # v untouched
    rotated = rotary.cos_sin_cache.shape[-1]
    assert torch.equal(got[..., rotated:], expected[..., rotated:])  # the rest passed through


# -- gated activations -----------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("width", [1536, 3, 40])
def test_gated_activations_equal_torch(fused: CpuKernels, gate: str, width: int) -> None:
    torch.manual_seed(width)
    x = torch.randn(2, 3, 2 * width) * 4
    x[0, 0, :width] = torch.linspace(-90, 90, width)  # the saturated ends of exp and tanh
    expected = getattr(TorchKernels(), gate)(x)
    got = getattr(fused, gate)(x)
    assert got.shape == expected.shape == (2, 3, width)
    g, u = x[..., :width], x[..., width:]
    # exp (or tanh) within a few ulps, then a handful of roundings, each of the product's
    # size; 1 + tanh cancels near -1, leaving an error of the size of g's
    bound = 16 * EPS * (1 + g.abs()) * u.abs()
    assert (got - expected).abs().le(bound).all()


# -- the KV write and paged decode attention -------------------------------------------------

STEPS = {
    "decode": [(0, 1), (15, 1), (40, 1), (7, 1)],
    "mixed": [(0, 7), (20, 1), (16, 5), (3, 1)],
    "long": [(300, 1), (1, 1)],
}


def _attention_bound(step: Any, layer: LayerAttention, expected: torch.Tensor) -> float:
    """A score is a dot of D products: D * eps of the sum of their sizes (a soft cap only
    shrinks it). softmax(s)·v moves by about twice the largest score error times max|v|,
    and the weighted sum of n values by n * eps of max|v|."""
    q, keys, values = step.q.abs(), step.kv_cache[0].abs(), step.kv_cache[1].abs()
    d, n = q.shape[-1], int(step.seq_lens.max())
    score = d * EPS * float(q.amax()) * float(keys.amax()) * d * layer.scale
    return (2 * score + (n + d) * EPS) * max(float(values.amax()), float(expected.abs().max()))


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("planned", sorted(STEPS))
@pytest.mark.parametrize("kind", ["plain", *sorted(model_kinds(8))])
def test_paged_decode_and_the_kv_write_equal_the_torch_backend(
    ops: Any, kind: str, planned: str, block_size: int
) -> None:
    """Scattered block ids, stale padding in the table, GQA, windows, soft caps, a
    query's own key only (length 1): the kernel reads the paged cache as the torch
    backend's gather does."""
    heads, kv_heads, head_dim = 6, 2, 8
    shape = Shape(block_size, heads, kv_heads, head_dim)
    plain = LayerAttention(head_dim**-0.5)
    kinds = [plain] if kind == "plain" else model_kinds(head_dim)[kind]
    for i, layer in enumerate(dict.fromkeys(kinds)):
        step = make_step(shape, STEPS[planned], 0, data_seed=i)
        expected, expected_cache = run_backend(
            TorchAttention(heads, kv_heads, head_dim), step, block_size, layer=layer
        )
        got, cache = run_backend(
            TorchAttention(heads, kv_heads, head_dim, ops), step, block_size, layer=layer
        )
        assert torch.equal(cache, expected_cache)
        bound = _attention_bound(step, layer, expected)
        assert float((got - expected).abs().max()) <= bound


def test_paged_decode_splits_heads_over_threads_and_keeps_the_result(ops: Any) -> None:
    """A batch big enough to be split over threads gives what one thread gives."""
    shape = Shape(16, 8, 2, 64)
    step = make_step(shape, [(200, 1)] * 16, 3)
    layer = LayerAttention(64**-0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial, _ = run_backend(TorchAttention(8, 2, 64, ops), step, 16, layer=layer)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(threads, 2))
    try:
        parallel, _ = run_backend(TorchAttention(8, 2, 64, ops), step, 16, layer=layer)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)  # each head's sums run in one order on any thread


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("planned", sorted(STEPS))
def test_a_float16_cache_is_written_rounded_and_read_widened(
    ops: Any, planned: str, head_dim: int
) -> None:
    """``kv_cache_dtype="float16"``: the kernel writes k and v rounded as torch rounds them
    to float16, and attends over the float16 cache, to the bit, as over a float32 cache
    holding the same rounded values; the torch backend (which widens what it gathers)
    writes the same cache and agrees within float32's bound."""
    heads, kv_heads = 6, 2
    step = make_step(Shape(16, heads, kv_heads, head_dim), STEPS[planned], 5)
    half = replace(step, kv_cache=step.kv_cache.half())
    rounded = replace(
        step, k=step.k.half().float(), v=step.v.half().float(), kv_cache=half.kv_cache.float()
    )
    got, cache = run_backend(TorchAttention(heads, kv_heads, head_dim, ops), half, 16)
    assert cache.dtype == torch.float16
    widened, widened_cache = run_backend(
        TorchAttention(heads, kv_heads, head_dim, ops), rounded, 16
    )
    assert torch.equal(cache.float(), widened_cache)
    assert torch.equal(got, widened)
    torch_got, torch_cache = run_backend(TorchAttention(heads, kv_heads, head_dim), half, 16)
    assert torch.equal(torch_cache, cache)
    bound = _attention_bound(rounded, LayerAttention(head_dim**-0.5), torch_got)
    assert float((got - torch_got).abs().max()) <= bound


def test_a_backend_made_with_the_extension_runs_it(ops: Any) -> None:
    backend = make_attention_backend(
        "torch", CPU, 6, 2, 8, torch.float32, [LayerAttention(0.3)], cpu_ops=ops
    )
    assert isinstance(backend, TorchAttention) and backend.cpu_ops is ops


# -- bad calls are errors, never bad reads ---------------------------------------------------


def _cache(slots: int = 32, kv_heads: int = 2, dim: int = 8) -> torch.Tensor:
    return torch.zeros(2, slots, kv_heads, dim)


def test_the_kv_write_refuses_a_slot_outside_the_cache(ops: Any) -> None:
    k = torch.randn(2, 2, 8)
    cache = _cache()
    for slot in (32, -1):
        with pytest.raises(RuntimeError, match="outside the cache"):
            ops.write_kv(cache, k, k, torch.tensor([0, slot]))
    assert not cache.any()  # checked before anything is written
    with pytest.raises(RuntimeError, match="must be"):
        ops.write_kv(cache, k, torch.randn(2, 2, 4), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="int64"):
        ops.write_kv(cache, k, k, torch.tensor([0, 1], dtype=torch.int32))


def test_paged_decode_refuses_blocks_and_lengths_outside_the_cache(ops: Any) -> None:
    q, cache = torch.randn(1, 4, 8), _cache()
    table = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="block 2 is outside"):
        ops.paged_decode(q, cache, torch.tensor([[0, 2]]), torch.tensor([20]), 16, 0.3, 0, 0.0)
    for length in (0, 33):
        with pytest.raises(RuntimeError, match="sequence length"):
            ops.paged_decode(q, cache, table, torch.tensor([length]), 16, 0.3, 0, 0.0)
    with pytest.raises(RuntimeError, match="block_size"):
        ops.paged_decode(q, cache, table, torch.tensor([4]), 5, 0.3, 0, 0.0)
    with pytest.raises(RuntimeError, match="heads"):
        ops.paged_decode(torch.randn(1, 3, 8), cache, table, torch.tensor([4]), 16, 0.3, 0, 0.0)
    # a block past a sequence's pages is stale padding, never read: accepted
    out = ops.paged_decode(q, cache, torch.tensor([[1, 99]]), torch.tensor([16]), 16, 0.3, 0, 0.0)
    assert out.shape == q.shape


def test_rope_refuses_a_position_outside_its_table(ops: Any) -> None:
    qk = torch.randn(2, 3, 8)
    before = qk.clone()
    table = torch.randn(16, 8)
    for position in (16, -1):
        with pytest.raises(RuntimeError, match="outside the table"):
            ops.rope(qk, torch.tensor([0, position]), table)
    assert torch.equal(qk, before)
    with pytest.raises(RuntimeError, match="at most"):
        ops.rope(qk, torch.tensor([0, 1]), torch.randn(16, 10))


def test_the_kernels_refuse_other_dtypes_and_strided_last_dimensions(ops: Any) -> None:
    with pytest.raises(RuntimeError, match="float32 or float16"):
        ops.write_kv(
            _cache().bfloat16(), torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.tensor([0, 1])
        )
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="2 \\* I"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="one"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6, 0.0)


# -- whole models ----------------------------------------------------------------------------


FAMILIES = ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_on_the_fused_kernels_computes_what_the_torch_ones_do(
    family: str, ops: Any, tmp_path: Path, tokenizer_dir: Path, tokenizer: Any
) -> None:
    """Every family's kernels (Gemma's norms and tanh-GELU, partial rotary, per-head and
    whole q/k norms, layers without RoPE, windows and soft caps) through prefill and then
    decode steps over the paged cache: the logits of each step agree."""
    folder = make_family_model(tmp_path / family, tokenizer_dir, family)
    theirs, ours = load_ours(folder), load_ours(folder)
    _use_cpu_ops(ours, ops)
    assert ours.config.num_layers >= 2  # the fused residual add runs between layers
    for prompt in PROMPTS[1:4]:
        ids = tokenizer(prompt).input_ids
        expected, got = _decode_logits(theirs, ids), _decode_logits(ours, ids)
        assert_logits_close(got, expected, ours.config)


def _use_cpu_ops(model: DecoderModel, ops: Any) -> None:
    kernels = CpuKernels(ops)
    model.kernels = kernels
    for m in model.modules():
        if isinstance(m, RMSNorm | Attention | GatedMLP):
            m.kernels = kernels
        if isinstance(m, Attention):
            m.backend.cpu_ops = ops


def _decode_logits(model: DecoderModel, ids: list[int], steps: int = 6) -> torch.Tensor:
    """The logits of a prefill of ``ids`` minus its last ``steps`` tokens, then of each of
    those as a decode step: [steps + 1, vocab]."""
    caches = PagedGreedyDriver(model).caches
    backend = model.layers[0].self_attn.backend
    n = len(ids)
    steps = min(steps, n - 1)
    table = torch.tensor([list(range(-(-n // BLOCK_SIZE)))[::-1]])  # pages out of order
    slots = torch.tensor(
        [int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
    )
    rows = rope_rows(model, n)
    out = []
    start = n - steps
    spans = [(0, start)] + [(p, p + 1) for p in range(start, n)]
    for lo, hi in spans:
        meta = AttentionMetadata(
            slot_mapping=slots[lo:hi],
            query_start_loc=torch.tensor([0, hi - lo]),
            seq_lens=torch.tensor([hi]),
            block_tables=table,
            max_query_len=hi - lo,
            max_seq_len=hi,
            host_query_start_loc=np.array([0, hi - lo]),
            host_seq_lens=np.array([hi]),
            host_block_tables=table.numpy(),
        )
        backend.prepare(meta, BLOCK_SIZE)
        with torch.inference_mode():
            logits = model(
                torch.tensor(ids[lo:hi]), rows[lo:hi], caches, meta, torch.tensor([hi - lo - 1])
            )
        out.append(logits[0])
    return torch.stack(out)
