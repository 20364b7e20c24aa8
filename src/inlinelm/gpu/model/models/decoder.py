"""The decoder every family shares, built for a paged KV cache.

One forward takes the flattened tokens of many sequences, their positions and the step's
attention metadata; it writes K/V into the cache and returns logits only for the rows in
``logits_indices``. A family's file (beside this one) subclasses what its architecture
changes: the layer (:class:`DecoderLayer`: pre-norm; Gemma's sandwich, OLMo 2's post-norm),
the embedding scale, the logits' last step.

The residual stream travels beside each block's output instead of being added at the end
of the block: the add is fused into the next norm (one kernel on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.attention.metadata import AttentionBackend, AttentionMetadata
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.kernels import Kernels, TorchKernels
from inlinelm.gpu.model.layers.attention import Attention, Ropes
from inlinelm.gpu.model.layers.embedding import Embedding
from inlinelm.gpu.model.layers.linear import Linear
from inlinelm.gpu.model.layers.mlp import GatedMLP
from inlinelm.gpu.model.layers.moe import SparseMoE
from inlinelm.gpu.model.layers.norm import RMSNorm
from inlinelm.gpu.model.layers.rotary import RotaryEmbedding
from inlinelm.gpu.model.rope import long_context_from


def make_mlp(cfg: ModelConfig, index: int, kernels: Kernels) -> nn.Module:
    """Layer ``index``'s MLP: the sparse one where the config says, else the dense one."""
    if cfg.layers[index].sparse:
        assert cfg.moe is not None, "a sparse layer comes with a MoE config"
        return SparseMoE(cfg.hidden_size, cfg.moe, kernels)
    return GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.activation, kernels, bias=cfg.mlp_bias
    )


def norm(cfg: ModelConfig, kernels: Kernels) -> RMSNorm:
    """A hidden-size RMSNorm of ``cfg``'s kind."""
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, cfg.norm_offset)


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block (Llama's)."""

    def __init__(
        self, cfg: ModelConfig, index: int, backend: AttentionBackend, kernels: Kernels
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(cfg, kernels)
        self.self_attn = Attention(cfg, cfg.layers[index], backend, kernels)
        self.post_attention_layernorm = norm(cfg, kernels)
        self.mlp = make_mlp(cfg, index, kernels)
        self.residual_scale = cfg.residual_scale

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: Ropes,
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
        x = self.scaled(self.self_attn(x, ropes, kv_cache, meta))
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.scaled(self.mlp(x)), residual

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A block's output as the residual stream adds it (Granite scales it)."""
        return x if self.residual_scale == 1.0 else x * self.residual_scale


class DecoderModel(nn.Module):
    """The whole decoder plus the LM head (tied to the embedding when the config says so)."""

    layer_class: type[nn.Module] = DecoderLayer

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
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, backend, self.kernels) for i in range(cfg.num_layers)
        )
        self.norm = norm(cfg, self.kernels)
        self.max_positions = max_positions
        self.rotary, self.local_rotary = _rotary_tables(cfg, max_positions)
        # NOTE: with tied embeddings the loader copies the embedding into lm_head's
        # transposed layout (one extra copy of the matrix, read at the faster rate).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the layers as one extension call for decode steps (see use_decoder_stack)
        self.decoder_stack: Any = None

    def use_decoder_stack(self, stack: Any) -> None:
        """Run decode steps through ``stack`` (a
        :class:`~inlinelm.gpu.model.decoder_stack.DecoderStack` of these layers, whose
        results are theirs to the bit), or the layers themselves for None."""
        self.decoder_stack = stack

    def set_max_positions(self, max_positions: int) -> None:
        """Rebuild the RoPE tables for ``max_positions`` (the loader builds the model on
        the meta device with one position, then calls this on the real one)."""
        device = self.embed_tokens.weight.device
        rotary, local = _rotary_tables(self.config, max_positions)
        self.max_positions = max_positions
        self.rotary = rotary.to(device)
        self.local_rotary = local.to(device) if local is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers over the flat batch; return float32 logits [len(logits_indices), V]."""
        return self.compute_logits(
            self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices)
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers over the flat batch; return the final-normed hidden states of the
        ``indices`` tokens ``[len(indices), hidden]`` (what the LM head reads)."""
        x = self.scale_embeddings(self.embed_tokens(input_ids))
        tables = [self.rotary.cos_sin_cache]
        if self.local_rotary is not None:
            tables.append(self.local_rotary.cos_sin_cache)
        stacked = None
        if self.decoder_stack is not None:
            stacked = self.decoder_stack.decode(x, positions, tables, kv_caches, meta)
        if stacked is None:
            x, residual = self.run_layers(x, positions, tables, kv_caches, meta)
        else:
            x, residual = stacked
        x, _ = self.norm.add_and_norm(x[indices], residual[indices])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, V]`` of final-normed hidden states."""
        return self.finish_logits(self.lm_head(hidden)).float()

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        tables: list[torch.Tensor],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the embeddings ``x``: ``(block output, residual)`` of the last
        (``tables``: the global RoPE table, then the local one when there is one)."""
        names = ("global", "local")[: len(tables)]
        ropes = {
            name: self.kernels.rope_inputs(table, positions, x.dtype)
            for name, table in zip(names, tables, strict=True)
        }
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, ropes, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return x, residual

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings as the first layer reads them (Granite multiplies them)."""
        scale = self.config.embedding_scale
        return x if scale == 1.0 else x * scale

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the family's reference returns it (Granite divides it)."""
        divisor = self.config.logits_divisor
        return logits if divisor == 1.0 else logits / divisor


def _rotary_tables(
    cfg: ModelConfig, max_positions: int
) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The global layers' RoPE table and the local layers' (None when they share one)."""
    if cfg.local_rope is not None and long_context_from(cfg.rope) is not None:
        # NOTE: the long rows' offsets would index the local table past its end.
        raise ModelLoadError("longrope with a separate RoPE for local layers is not supported")
    rotary = RotaryEmbedding(cfg.rope, cfg.rotated_dim, max_positions)
    if cfg.local_rope is None:
        return rotary, None
    return rotary, RotaryEmbedding(cfg.local_rope, cfg.rotated_dim, max_positions)
