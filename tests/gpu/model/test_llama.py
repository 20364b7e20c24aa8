"""Our Llama-family model against transformers: prefill logits and batched greedy decoding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm.gpu.model.layers.linear import Linear, onednn_packing_available
from tests.gpu.conftest import GreedyReference, OursModel, ReferenceModel
from tests.gpu.reference import (
    PROMPTS,
    PagedGreedyDriver,
    assert_logits_close,
    load_ours,
    logits_atol,
    prefill_logits,
)

LoneDecode = Callable[[Path, int], list[int]]


@pytest.fixture(params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"{request.param}_model_dir"))


@pytest.fixture(scope="module")
def lone_decode(tokenizer: Any, ours_model: OursModel) -> LoneDecode:
    """``lone_decode(folder, i)``: our 32 greedy tokens for ``PROMPTS[i]`` decoded as the
    only sequence of its batch, once per module. A lone decode row is attended on one
    thread; the thread count is back where it was after each decode."""

    @functools.cache
    def decode(folder: Path, i: int) -> list[int]:
        threads = torch.get_num_threads()
        ids = tokenizer(PROMPTS[i]).input_ids
        (got,) = PagedGreedyDriver(ours_model(folder)).generate([ids], max_new_tokens=32, chunk=64)
        assert torch.get_num_threads() == threads
        return got

    return decode


def test_prefill_logits_match_transformers(
    model_dir: Path, tokenizer: Any, ours_model: OursModel, reference_model: ReferenceModel
) -> None:
    ours, ref = ours_model(model_dir), reference_model(model_dir)
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0].float()
        got = prefill_logits(ours, ids)
        assert_logits_close(got, expected, ours.config)
        # The greedy choice is exact wherever the reference's best two logits are further
        # apart than two tolerances (closer is a tie at float32 precision).
        top2 = expected.topk(2, dim=-1).values
        decisive = top2[:, 0] - top2[:, 1] > 2 * logits_atol(ours.config, expected)
        assert decisive.float().mean() > 0.5
        assert torch.equal(got.argmax(-1)[decisive], expected.argmax(-1)[decisive])


def test_a_one_percent_weight_change_fails_the_logits_check(
    model_dir: Path, tokenizer: Any, ours_model: OursModel, reference_model: ReferenceModel
) -> None:
    """The tolerance sits far below a real model error: one mid-depth weight matrix scaled
    by 1.01 moves the logits of the longest prompt more than ten tolerances."""
    ours, ref = ours_model(model_dir), reference_model(model_dir)
    weight = ref.model.layers[ours.config.num_layers // 2].mlp.down_proj.weight
    original = weight.detach().clone()
    ids = tokenizer(PROMPTS[4]).input_ids
    try:
        with torch.no_grad():
            weight.mul_(1.01)
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0].float()
    finally:
        with torch.no_grad():
            weight.copy_(original)  # NOTE: the session's other tests share this model
    got = prefill_logits(ours, ids)
    assert (got - expected).abs().max() > 10 * logits_atol(ours.config, expected)
    with pytest.raises(AssertionError, match="not close"):
        assert_logits_close(got, expected, ours.config)


def test_batched_chunked_greedy_matches_transformers(
    model_dir: Path, tokenizer: Any, ours_model: OursModel, greedy_reference: GreedyReference
) -> None:
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    got = PagedGreedyDriver(ours_model(model_dir)).generate(prompts, max_new_tokens=32, chunk=7)
    assert got == greedy_reference(model_dir)


@pytest.mark.slow
def test_default_model_answers_sensibly(
    default_model_dir: Path, tokenizer: Any, lone_decode: LoneDecode
) -> None:
    """The dequantized GGUF is a working model, not just one that matches itself: its first
    8 greedy tokens (those of a lone 32-token decode) name the capital."""
    assert PROMPTS[1] == "The capital of France is"
    assert "Paris" in tokenizer.decode(lone_decode(default_model_dir, 1)[:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_onednn_packed_linear_equals_the_plain_matmul(
    bias: bool, rows: int, dtype: torch.dtype
) -> None:
    if not onednn_packing_available(torch.device("cpu"), dtype):
        pytest.skip(f"this torch or CPU has no oneDNN {dtype} matmul")
    torch.manual_seed(rows)
    layer = Linear(96, 320, bias=bias).to(dtype)
    torch.nn.init.normal_(layer.weight_t)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        expected = layer(x)
        assert layer.pack_for_onednn()
        got = layer(x)
    assert layer.weight_t.numel() == 0  # the plain copy is dropped
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:
        # both sum in float32 (in other orders) and round the sum once to bfloat16: one
        # bfloat16 step of the result apart, at most
        step = torch.finfo(dtype).eps * expected.float().abs()
        assert ((got.float() - expected.float()).abs() <= step + 1e-3).all()


def test_a_cpu_bfloat16_model_packs_its_weights_and_computes_the_float32_model(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """``dtype="bfloat16"`` on a CPU: the weights packed for oneDNN's bfloat16 GEMM where
    the CPU has bfloat16 instructions, and the logits those of the float32 model within
    bfloat16's rounding."""
    from inlinelm.gpu.attention.torch_backend import TorchAttention
    from inlinelm.gpu.loading.weights import load_model
    from inlinelm.gpu.model.registry import read_model_config

    cfg = read_model_config(tiny_model_dir)
    model = load_model(
        tiny_model_dir,
        cfg,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        backend=TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        max_positions=2048,
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    packed = onednn_packing_available(torch.device("cpu"), torch.bfloat16)
    assert linears and all((m._packed is not None) == packed for m in linears)
    plain = load_ours(tiny_model_dir)
    for prompt in PROMPTS[1:4]:
        ids = tokenizer(prompt).input_ids
        want = prefill_logits(plain, ids)
        got = prefill_logits(model, ids)
        assert got.dtype == torch.float32
        # Each layer rounds to bfloat16 about eight times (its four weight matrices, their
        # outputs, its norms' outputs), each a relative eps / 2 (sums run in float32): a
        # random walk of 8 * num_layers steps, carried to the logits at their own size.
        steps = 8 * cfg.num_layers
        atol = torch.finfo(torch.bfloat16).eps * steps**0.5 * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0.0, atol=atol)


def test_a_cpu_float32_model_keeps_only_packed_weights(
    tiny_model_dir: Path, ours_model: OursModel
) -> None:
    if not onednn_packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    linears = [m for m in ours_model(tiny_model_dir).modules() if isinstance(m, Linear)]
    assert linears
    assert all(m._packed is not None and m.weight_t.numel() == 0 for m in linears)


def test_one_sequence_alone_decodes_like_transformers(
    model_dir: Path, lone_decode: LoneDecode, greedy_reference: GreedyReference
) -> None:
    """A lone decode row is attended on one thread; the answer and thread count stay put
    (``lone_decode`` checks the count around each decode)."""
    threads = torch.get_num_threads()
    for i in (1, 4):
        assert lone_decode(model_dir, i) == greedy_reference(model_dir)[i]
    assert torch.get_num_threads() == threads


def test_a_layer_whose_packing_fails_stays_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    if not onednn_packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    layer = Linear(16, 8)
    torch.nn.init.normal_(layer.weight_t)
    x = torch.randn(3, 16)
    expected = layer(x).detach()

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    assert layer.pack_for_onednn() is False
    assert layer._packed is None and layer.weight_t.shape == (16, 8)
    torch.testing.assert_close(layer(x).detach(), expected)
