"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) built for a paged KV cache.

One forward takes the flattened tokens of many sequences, their positions and the step's
attention metadata; it writes K/V into the cache and returns logits only for the rows in
``logits_indices``. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inlinelm.gpu.attention import AttentionBackend, AttentionMetadata
from inlinelm.gpu.model_config import ModelConfig, RopeConfig


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored transposed, as ``weight_t`` [in, out].

    A decode step is a batch of GEMVs; on a CPU, MKL reads a row-major [in, out] matrix
    at ~1.7x the bandwidth of the usual [out, in] layout (measured on this project's
    2-core machines: ~26 vs ~15 GB/s), and decode is bound by reading the weights.

    :meth:`pack_for_onednn` goes further on a CPU: it re-lays the weight out in oneDNN's
    blocked format and drops the plain copy. oneDNN's GEMM splits even a one-row GEMV
    over every intra-op thread and picks AVX-512 kernels on any x86 vendor; MKL's does
    neither here (measured on this model's shapes, 2 threads: the 538 MB of weights in
    16 ms instead of 24 ms at one row, 36 ms instead of 77 ms at 32 rows).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None

    def pack_for_onednn(self) -> bool:
        """Keep the weight only in oneDNN's CPU layout (after loading; not reversible).

        The packed layer is checked against the plain matmul on a small input first; on any
        error or mismatch (these are torch-internal ops) the layer stays as it was and
        False is returned.
        """
        weight = self.weight_t.data.t().contiguous()
        probe = torch.randn(2, weight.shape[1], dtype=weight.dtype)
        with torch.no_grad():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            except (RuntimeError, TypeError, AttributeError):
                return False
            if not torch.allclose(got, self(probe), rtol=1e-4, atol=1e-4):
                return False
        self._packed = packed
        self.weight_t.data = torch.empty(0, dtype=weight.dtype)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [], ""
            )
            return out
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :meth:`Linear.pack_for_onednn` applies: float32 on a CPU torch built with
    oneDNN (other dtypes depend on the CPU's instructions, so they keep plain matmuls)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


ONEDNN_BATCH_HINT = 16
"""Rows oneDNN lays the weights out for; one layout serves every row count (measured:
within 15% of the best hint from 1 to 512 rows)."""


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementation does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel instead of seven ops (a decode step is dispatch-bound here).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by position (default or llama3 frequencies)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = _inv_freq(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table: torch.Tensor
        self.sin_table: torch.Tensor
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_table[positions].to(dtype)
        sin = self.sin_table[positions].to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def _inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Self-attention with a fused QKV projection, RoPE and grouped KV heads."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # NOTE: queries and keys rotate together: one set of RoPE ops per layer, not two.
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        cos, sin = rope
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        result: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
        return result


class MLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        result: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return result


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus the LM head (tied to the embedding when the config says so)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        # NOTE: with tied embeddings the loader copies the embedding into lm_head's
        # transposed layout (one extra copy of the matrix, read at the faster rate).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers over the flat batch; return float32 logits [len(logits_indices), V]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta)
        x = self.norm(x[logits_indices])
        logits: torch.Tensor = self.lm_head(x)
        return logits.float()
