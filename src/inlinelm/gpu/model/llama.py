"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) built for a paged KV cache.

One forward takes the flattened tokens of many sequences, their positions and the step's
attention metadata; it writes K/V into the cache and returns logits only for the rows in
``logits_indices``. Q/K/V and gate/up projections are fused into one matmul each (the
loader concatenates the checkpoint's tensors), and the norms, RoPE and SiLU-and-mul go
through the :class:`~inlinelm.gpu.model.kernels.Kernels` chosen when the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.attention.metadata import AttentionBackend, AttentionMetadata, LayerAttention
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.kernels import Kernels, RopeInputs, TorchKernels
from inlinelm.gpu.model.rope import RopeConfig, cos_sin_cache


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
    """Root-mean-square norm; :meth:`add_and_norm` fuses the residual add before it."""

    def __init__(self, size: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; may overwrite both inputs."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position up to ``max_positions`` (default or llama3
    frequencies), in float32, laid out as :class:`~inlinelm.gpu.model.kernels.RopeInputs` says."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", cos_sin_cache(rope, head_dim, max_positions), persistent=False
        )


class Attention(nn.Module):
    """Self-attention with a fused QKV projection, RoPE and grouped KV heads."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, kernels: Kernels) -> None:
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
        self.layer = LayerAttention(scale=cfg.head_dim**-0.5)
        self.kernels = kernels

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = self.kernels.apply_rope(qk, self.num_heads, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.layer)
        result: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
        return result


class MLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
        return result


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block.

    The residual stream travels beside the block output instead of being added at the end
    of each block: the add is fused into the next norm (one kernel on CUDA).
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, kernels: Kernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, backend, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, kernels)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block output, residual)``; their sum is the layer's output. The first layer
        gets ``residual=None`` and ``x`` = the embeddings."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus the LM head (tied to the embedding when the config says so)."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels or TorchKernels()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, self.kernels) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.kernels)
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
        rope = self.kernels.rope_inputs(self.rotary.cos_sin_cache, positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        x, _ = self.norm.add_and_norm(x[logits_indices], residual[logits_indices])
        logits: torch.Tensor = self.lm_head(x)
        return logits.float()
