"""The model's kernels: the torch ones are what a CPU model runs; the FlashInfer wiring
(argument order, in-place contracts, table layout) is checked on a CPU against a stand-in
module written from FlashInfer's documented semantics; the real kernels against the torch
ones on a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inlinelm.gpu.model.kernels import FlashInferKernels, Kernels, TorchKernels, make_kernels
from inlinelm.gpu.model.layers.attention import Attention
from inlinelm.gpu.model.layers.mlp import GatedMLP
from inlinelm.gpu.model.layers.norm import RMSNorm
from inlinelm.gpu.model.layers.rotary import RotaryEmbedding
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.gpu.model.rope import RopeConfig
from tests.gpu.families import make_family_model
from tests.gpu.reference import PROMPTS, load_ours, prefill_logits


def test_make_kernels_picks_by_kind() -> None:
    assert isinstance(make_kernels("torch"), TorchKernels)
    assert make_kernels("torch").kind == "torch"


def test_a_model_built_without_kernels_runs_torch_ones_everywhere(tiny_model_dir: Path) -> None:
    model = load_ours(tiny_model_dir)
    assert isinstance(model.kernels, TorchKernels)
    users = [m for m in model.modules() if isinstance(m, RMSNorm | Attention | GatedMLP)]
    assert users and all(m.kernels is model.kernels for m in users)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2"])
def test_flashinfer_kernels_wiring_matches_torch_on_a_stand_in(
    family: str,
    fake_flashinfer: None,
    tmp_path: Path,
    tokenizer_dir: Path,
    tokenizer: object,
) -> None:
    """The model through FlashInferKernels (in-place norms and RoPE, FlashInfer's table
    layout, Gemma's norms and tanh-GELU, partial rotary, per-head and whole q/k norms)
    computes what the torch kernels compute."""
    assert isinstance(make_kernels("flashinfer"), FlashInferKernels)
    folder = make_family_model(tmp_path / family, tokenizer_dir, family)
    cfg = read_model_config(folder)
    ours, theirs = load_ours(folder), load_ours(folder)
    _use_kernels(theirs, FlashInferKernels())
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt).input_ids  # type: ignore[operator]
        torch.testing.assert_close(
            prefill_logits(theirs, ids), prefill_logits(ours, ids), rtol=1e-4, atol=1e-4
        )
    assert cfg.num_layers >= 2  # the fused residual add runs between layers


def _use_kernels(model: DecoderModel, kernels: Kernels) -> None:
    model.kernels = kernels
    for m in model.modules():
        if isinstance(m, RMSNorm | Attention | GatedMLP):
            m.kernels = kernels


@pytest.mark.parametrize("kind", ["torch", "flashinfer"])
def test_rope_rotates_queries_and_keys_like_the_reference(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "flashinfer":
        request.getfixturevalue("fake_flashinfer")
    kernels = make_kernels("flashinfer" if kind == "flashinfer" else "torch")
    head_dim, heads, kv_heads, tokens = 16, 4, 2, 7
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64)
    positions = torch.tensor([0, 1, 2, 5, 9, 33, 63])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    expected = _reference_rope(qk.clone(), positions, head_dim, 10000.0)
    rope = kernels.rope_inputs(rotary.cos_sin_cache, positions, torch.float32)
    got = kernels.apply_rope(qk, heads, rope)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _reference_rope(
    x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float
) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# -- on the device --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_kernels_equal_the_torch_ones_on_cuda(dtype: torch.dtype) -> None:
    pytest.importorskip("flashinfer")
    device = torch.device("cuda")
    fi, ref = FlashInferKernels(), TorchKernels()
    torch.manual_seed(0)
    tokens, hidden, heads, kv_heads, head_dim = 37, 576, 9, 3, 64
    tol = {"rtol": 2e-2, "atol": 2e-2}
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    torch.testing.assert_close(fi.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), **tol)
    want_norm, want_sum = ref.add_rms_norm(x, residual, weight, 1e-5)
    got_norm, got_sum = fi.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got_sum, want_sum, **tol)
    torch.testing.assert_close(got_norm, want_norm, **tol)
    gate_up = torch.randn(tokens, 2 * 1536, device=device, dtype=dtype)
    torch.testing.assert_close(fi.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)
    rotary = RotaryEmbedding(RopeConfig(theta=100000.0), head_dim, 4096).to(device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = ref.apply_rope(qk, heads, ref.rope_inputs(rotary.cos_sin_cache, positions, dtype))
    got = fi.apply_rope(qk, heads, fi.rope_inputs(rotary.cos_sin_cache, positions, dtype))
    torch.testing.assert_close(got, want, **tol)
