"""Self-attention: a fused QKV projection, the optional q/k norms, RoPE over the first
dimensions of each head (or none), grouped KV heads, and the layer's
:class:`~inlinelm.gpu.attention.metadata.LayerAttention` (scale, window, soft cap)."""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.attention.metadata import AttentionBackend, AttentionMetadata
from inlinelm.gpu.model.config import LayerSpec, ModelConfig
from inlinelm.gpu.model.kernels import Kernels, RopeInputs
from inlinelm.gpu.model.layers.linear import Linear
from inlinelm.gpu.model.layers.norm import RMSNorm

Ropes = dict[str, RopeInputs]
"""One forward's RoPE inputs by table (``"global"``, and ``"local"`` for Gemma 3)."""


class Attention(nn.Module):
    """One layer's attention. ``qk_norm`` (the config's) normalises the queries and keys
    before RoPE: ``"head"`` per head (Qwen3, Gemma 3), ``"whole"`` over the whole
    projection (OLMo 2)."""

    def __init__(
        self, cfg: ModelConfig, spec: LayerSpec, backend: AttentionBackend, kernels: Kernels
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            whole = cfg.qk_norm == "whole"
            eps, offset = cfg.rms_norm_eps, cfg.norm_offset
            self.q_norm = RMSNorm(self.q_size if whole else cfg.head_dim, eps, kernels, offset)
            self.k_norm = RMSNorm(self.kv_size if whole else cfg.head_dim, eps, kernels, offset)
        self.layer = spec.attention
        self.rope = spec.rope
        self.backend = backend
        self.kernels = kernels

    def forward(
        self,
        x: torch.Tensor,
        ropes: Ropes,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk = self._queries_and_keys(qkv)
        if self.rope is not None:
            qk = self.kernels.apply_rope(qk, self.num_heads, ropes[self.rope])
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.layer)
        result: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
        return result

    def _queries_and_keys(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, Hq + Hkv, D]: the queries then the keys, normalised as configured."""
        heads = self.num_heads + self.num_kv_heads
        if self.qk_norm == "none":
            return qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.qk_norm == "whole":
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1)
            return qk.view(-1, heads, self.head_dim)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        return torch.cat((q, k), dim=1)
