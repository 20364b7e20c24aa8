"""Paged attention: metadata for one step, and the pure-torch CPU backend.

One forward carries the flattened tokens of many sequences (prefill chunks and decode
tokens mixed). Each layer writes its new K/V into the paged cache at ``slot_mapping`` and
attends over the sequence's whole context through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and passed to every layer.

    ``query_start_loc[i]:query_start_loc[i+1]`` are sequence ``i``'s tokens in the flat batch;
    ``seq_lens[i]`` is its context length once this step's tokens are written.
    """

    slot_mapping: torch.Tensor  # [T] int64, flat cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    max_query_len: int
    max_seq_len: int
    # Derived by the backend's prepare() for its own use.
    gather_slots: torch.Tensor | None = None  # [B, max_seq_len] flat slots of each context position
    attn_mask: torch.Tensor | None = None  # [B, 1, max_query_len, max_seq_len] bool
    query_index: torch.Tensor | None = None  # [T] position of each token in the padded [B * max_q]


class AttentionBackend(Protocol):
    """Computes attention for one layer against the paged KV cache."""

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Fill the derived fields of ``meta`` once per step (shared by all layers)."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write ``k``/``v`` [T, KVH, D] into ``kv_cache`` [2, slots, KVH, D]; return [T, H, D]."""
        ...


class TorchAttention:
    """Vectorised CPU attention: pad queries per sequence, gather the context, one SDPA call.

    No Python loop over tokens or sequences. Padded key positions point at a real slot and
    are masked; padded query rows attend to position 0 so they never produce NaN.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Compute the gather slots, the causal mask and the query scatter index."""
        device = meta.seq_lens.device
        positions = torch.arange(meta.max_seq_len, device=device)
        block_index = (positions // block_size).clamp_(max=meta.block_tables.shape[1] - 1)
        blocks = meta.block_tables[:, block_index]
        meta.gather_slots = blocks * block_size + positions % block_size
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        meta.query_index, query_pos = _query_layout(meta, query_lens)
        # Query j of sequence i sits at absolute position seq_len - query_len + j.
        key_pos = positions.view(1, 1, -1)
        first = (meta.seq_lens - query_lens).view(-1, 1, 1)
        q_abs = first + query_pos.view(1, -1, 1)
        valid_q = query_pos.view(1, -1, 1) < query_lens.view(-1, 1, 1)
        mask = (key_pos <= q_abs) & valid_q
        mask[:, :, 0] |= ~valid_q[:, :, 0]
        meta.attn_mask = mask.unsqueeze(1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """See :class:`AttentionBackend`."""
        assert meta.gather_slots is not None and meta.attn_mask is not None
        assert meta.query_index is not None
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        keys = kv_cache[0][meta.gather_slots].transpose(1, 2)  # [B, KVH, L, D]
        values = kv_cache[1][meta.gather_slots].transpose(1, 2)
        num_seqs = meta.seq_lens.shape[0]
        padded = q.new_zeros(num_seqs * meta.max_query_len, self.num_heads, self.head_dim)
        padded[meta.query_index] = q
        queries = padded.view(
            num_seqs, meta.max_query_len, self.num_heads, self.head_dim
        ).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.attn_mask, scale=self.scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(
            num_seqs * meta.max_query_len, self.num_heads, self.head_dim
        )
        return out[meta.query_index]


def _query_layout(
    meta: AttentionMetadata, query_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each flat token in the padded [B * max_q] layout, and the padded positions."""
    device = query_lens.device
    num_tokens = int(meta.query_start_loc[-1])
    seq_of_token = torch.repeat_interleave(
        torch.arange(query_lens.shape[0], device=device), query_lens, output_size=num_tokens
    )
    offset = torch.arange(num_tokens, device=device) - meta.query_start_loc[seq_of_token]
    index = seq_of_token * meta.max_query_len + offset
    return index, torch.arange(meta.max_query_len, device=device)
