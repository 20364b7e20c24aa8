"""Int8 weights on a CPU (``quantization``): the kernel, the layers it picks, and quality.

- the kernel computes ``x @ (q * scale).T + b`` to float32's rounding, for every path
  (row blocks of 8, 4 and 1, weight-row tails, the vector tail of the input size, and
  the dequantized bands past ``FEW_ROWS_MAX`` rows);
- a model with int8 weights gives the logits of the same model with its weights replaced
  by their int8 values (the only error is the weights' rounding), and those are not the
  float model's (the test would see a kernel that ignored the quantization);
- ``"auto"`` quantizes what a GGUF file holds quantized and no float checkpoint;
- on the default model, teacher-forced on float32's greedy answers, int8's top-1 token
  agrees with float32's at >= 97% of positions.
"""

from __future__ import annotations

import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.model import cpu_extension as extension
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.layers.int8 import (
    FEW_ROWS_MAX,
    dequantize,
    int8_matmul,
    quantize_groups,
    quantize_rows,
)
from inlinelm.gpu.model.layers.linear import Linear
from tests.gpu.reference import load_ours, logits_atol, prefill_logits

pytestmark = pytest.mark.skipif(cpu_extension() is None, reason="the CPU extension did not build")

U = torch.finfo(torch.float32).eps / 2


def reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product in float64, and float32's bound on a K-term sum's error (a scale
    per row, or per group of a row)."""
    w = dequantized(q, scale).double()
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    return exact, (x.shape[1] + 2) * U * magnitude + 1e-30


def assert_the_dequantized_product(
    q: torch.Tensor, scale: torch.Tensor, rows: int, with_bias: bool, gen: torch.Generator
) -> None:
    """The kernel on ``rows`` random inputs (and a random bias) is the exact product of the
    dequantized weights within float32's bound."""
    out, inp = q.shape
    x = torch.randn(rows, inp, generator=gen) * 3
    bias = torch.randn(out, generator=gen) if with_bias else None
    exact, bound = reference(x, q, scale, bias)
    got = int8_matmul(x, q, scale, bias)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound).all()


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` times its scales in float32: one per row ([N]) or per group ([N, S])."""
    groups = scale.reshape(q.shape[0], -1)
    return (q.float().reshape(q.shape[0], groups.shape[1], -1) * groups[:, :, None]).reshape(
        q.shape
    )


def test_group_quantization_is_each_groups_own_and_dequantizes_within_half_a_step() -> None:
    weight = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    weight[:, 32:64] *= 100
    q, scale = quantize_groups(weight, 4)
    assert scale.shape == (6, 4)
    assert torch.equal(q[:, 64:96], quantize_rows(weight[:, 64:96])[0])
    assert torch.equal(dequantize(q, scale), dequantized(q, scale))
    error = (dequantize(q, scale) - weight).abs().reshape(6, 4, 32)
    assert (error <= scale[:, :, None] / 2 * (1 + 1e-6)).all()
    per_row = (dequantize(*quantize_rows(weight)) - weight).abs()
    assert per_row[:, 64:].max() > 10 * error[:, 2:].max(), "groups keep small groups fine"


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 13, FEW_ROWS_MAX + 1])
@pytest.mark.parametrize(("out", "inp", "group"), [(962, 576, 32), (7, 64, 32), (33, 64, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_group_scales_are_the_dequantized_product(
    rows: int, out: int, inp: int, group: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out + group)
    weight = torch.randn(out, inp, generator=gen)
    weight[:, :group] *= 50  # NOTE: one large group per row: a per-row scale would blur the rest
    q, scale = quantize_groups(weight, inp // group)
    assert_the_dequantized_product(q, scale, rows, with_bias, gen)
    kernel = cpu_extension()
    assert torch.equal(kernel.dequantize_rows(q, scale, 3, 7), dequantized(q, scale)[3:7])


def test_group_scales_that_do_not_split_the_rows_are_refused() -> None:
    q = torch.zeros(4, 64, dtype=torch.int8)
    x = torch.zeros(1, 64)
    for scale in (torch.ones(4, 3), torch.ones(4, 128), torch.ones(3, 2), torch.ones(4, 2, 1)):
        with pytest.raises(RuntimeError, match=r"group|scale"):
            int8_matmul(x, q, scale, None)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 16, 33, FEW_ROWS_MAX, FEW_ROWS_MAX + 1])
@pytest.mark.parametrize(("out", "inp"), [(962, 577), (7, 64), (33, 15)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_the_dequantized_product(
    rows: int, out: int, inp: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out)
    q, scale = quantize_rows(torch.randn(out, inp, generator=gen))
    assert_the_dequantized_product(q, scale, rows, with_bias, gen)


@pytest.mark.parametrize("gemm", ["onednn", "torch"])
@pytest.mark.parametrize("band_rows", [100, 962, 5000], ids=["bands", "one-band", "wide-band"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_many_rows_go_through_dequantized_bands_on_either_gemm(
    gemm: str, band_rows: int, with_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past FEW_ROWS_MAX rows: oneDNN's GEMM over bands of dequantized rows (a last band
    shorter than the others, and one band for the whole weight), or, where this torch has
    no oneDNN, the kernel's own bands through torch's GEMM."""
    from inlinelm.gpu.model.layers import int8

    if gemm == "onednn" and not int8._onednn_linear():
        pytest.skip("this torch has no oneDNN")
    if gemm == "torch":
        monkeypatch.setattr(int8, "_onednn_linear", lambda: False)
    monkeypatch.setattr(int8, "BAND_FLOATS", band_rows * 577)
    gen = torch.Generator().manual_seed(band_rows)
    q, scale = quantize_rows(torch.randn(962, 577, generator=gen))
    x = torch.randn(FEW_ROWS_MAX + 3, 577, generator=gen) * 3
    bias = torch.randn(962, generator=gen) if with_bias else None
    exact, bound = reference(x, q, scale, bias)
    got = int8_matmul(x, q, scale, bias)
    assert got.shape == (FEW_ROWS_MAX + 3, 962)
    assert ((got.double() - exact).abs() <= bound).all()


def test_dequantized_rows_are_the_int8_values_times_their_scales() -> None:
    q, scale = quantize_rows(torch.randn(40, 33))
    kernel = cpu_extension()
    assert torch.equal(kernel.dequantize_rows(q, scale, 5, 17), q[5:17].float() * scale[5:17, None])
    assert kernel.dequantize_rows(q, scale, 40, 40).shape == (0, 33)
    for n0, n1 in ((-1, 3), (3, 41), (5, 4)):
        with pytest.raises(RuntimeError, match="outside"):
            kernel.dequantize_rows(q, scale, n0, n1)


def test_a_batch_of_sequences_and_bfloat16_inputs_keep_their_shape_and_dtype() -> None:
    q, scale = quantize_rows(torch.randn(24, 32))
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    got = int8_matmul(x, q, scale, None)
    assert got.shape == (2, 5, 24) and got.dtype == torch.bfloat16
    want = int8_matmul(x.float().reshape(10, 32), q, scale, None).reshape(2, 5, 24)
    torch.testing.assert_close(got, want.bfloat16())


def test_rows_are_quantized_symmetrically_within_half_a_step() -> None:
    weight = torch.randn(16, 40)
    weight[3] = 0.0
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    assert scale[3] == 1.0 and (q[3] == 0).all()
    assert (q.abs().amax(dim=1)[torch.arange(16) != 3] == 127).all()
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()


def fake_quantized(folder: Path) -> torch.nn.Module:
    """The float model with each linear weight and the embedding replaced by its int8 value
    times its scale (a tied LM head is then the int8 embedding's), per row or per group as
    the loader's plan says (a Q8_0 file's blocks)."""
    import inlinelm.gpu.loading.weights as weights

    # NOTE: unpacked (oneDNN's layout is opaque), so the weights can be rewritten

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights, "onednn_packing_available", lambda *args: False)
        model = load_ours(folder)
    plan = weights.int8_plan(model, model.config, folder, "int8")
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            q, scale = quantize_groups(module.weight_t.data.t(), plan[name])
            module.weight_t.data = dequantize(q, scale).t().contiguous()
    q, scale = quantize_groups(model.embed_tokens.weight.data, plan["embed_tokens"])
    model.embed_tokens.weight.data = dequantize(q, scale)
    return model


def test_an_int8_model_computes_the_model_of_its_int8_weights(tiny_model_dir: Path) -> None:
    ids = list(range(5, 45))
    ours = load_ours(tiny_model_dir, "int8")
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert linears and all(m.is_int8 for m in linears)
    got = prefill_logits(ours, ids)
    want = prefill_logits(fake_quantized(tiny_model_dir), ids)
    atol = logits_atol(ours.config, want)
    torch.testing.assert_close(got, want, rtol=0.0, atol=atol)
    plain = prefill_logits(load_ours(tiny_model_dir), ids)
    assert (plain - want).abs().max() > 10 * atol, "int8 weights change the logits"


def int8_count(model: torch.nn.Module) -> tuple[int, int]:
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return sum(m.is_int8 for m in linears), len(linears)


@pytest.mark.slow
def test_auto_quantizes_what_a_gguf_holds_quantized_and_no_float_checkpoint(
    tiny_model_dir: Path,
) -> None:
    default = resolve_model("default").folder  # a Q4_1 GGUF's conversion
    assert int8_count(load_ours(default, "auto")) == (121, 121)  # the tied head too
    assert int8_count(load_ours(default, "none"))[0] == 0
    assert int8_count(load_ours(tiny_model_dir, "auto"))[0] == 0
    quantized, total = int8_count(load_ours(tiny_model_dir, "int8"))
    assert quantized == total > 0


def test_the_option_is_checked_and_cuda_keeps_float_weights() -> None:
    with pytest.raises(ConfigError, match="quantization must be one of auto, int8, none"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(device="cuda", quantization="int8")
    assert EngineConfig(device="cuda").weight_quantization == "none"
    assert EngineConfig().weight_quantization == "auto"


AGREEMENT = 0.97
"""Issue 24's bound: measured 0.9756 on this model (int8 with float inputs)."""


@pytest.mark.slow
def test_int8_agrees_with_float32_on_the_default_models_greedy_answers(tokenizer: Any) -> None:
    from inlinelm import Engine, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from _common import quality_prompts

    prompts = quality_prompts(tokenizer)
    folder = resolve_model("default").folder
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with closing(Engine(quantization="none", num_threads=2)) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
    answers = [list(out.outputs[0].token_ids) for out in outs]
    float_model, int8_model = load_ours(folder, "none"), load_ours(folder, "auto")
    agree = total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = [*prompt, *answer]
        want = prefill_logits(float_model, ids)[len(prompt) - 1 : -1].argmax(-1)
        got = prefill_logits(int8_model, ids)[len(prompt) - 1 : -1].argmax(-1)
        agree += int((got == want).sum())
        total += len(answer)
    print(f"int8 top-1 agreement with float32: {agree}/{total} = {agree / total:.4f}")
    assert agree >= AGREEMENT * total


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start() -> None:
    # torch waits on its build lock for as long as it exists; a build killed midway (a
    # Ctrl-C during the first start) leaves it behind.
    import os
    import subprocess

    kernel = cpu_extension()
    build = Path(kernel.__file__).parent
    lock = build / "lock"
    assert not lock.exists(), "no build runs now"
    lock.touch()
    old = time.time() - 2 * extension.STALE_LOCK_S
    os.utime(lock, (old, old))
    code = "from inlinelm.gpu.model.cpu_extension import cpu_extension; assert cpu_extension()"
    try:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    finally:
        lock.unlink(missing_ok=True)
