"""Bidirectional self-attention over a ragged batch, and ModernBERT's rotary embedding.

Each group of the batch's fused QKV rows is padded into ``[S, heads, L, head_dim]``,
attended with one ``scaled_dot_product_attention`` call under a boolean mask, and
gathered back to rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inlinelm.gpu.model.encoders.ragged import AttentionGroup, RaggedBatch

Rotary = tuple[torch.Tensor, torch.Tensor]
"""``(cos, sin)``, each ``[L, head_dim]`` float32, for positions ``0..L-1`` (``L`` at
least the batch's longest sequence)."""


def self_attention(
    qkv: torch.Tensor,
    batch: RaggedBatch,
    num_heads: int,
    masks: tuple[torch.Tensor | None, ...],
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """Attend ``qkv`` (``[T, 3 * hidden]``: queries, keys, values, in the batch's sorted
    layout) within each sequence.

    ``masks`` holds one mask per group of the batch (:meth:`RaggedBatch.attention_masks`);
    ``rotary`` rotates queries and keys first. Returns ``[T, hidden]``, the heads side by
    side.
    """
    num_tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    heads = qkv.view(num_tokens, 3, num_heads, hidden // num_heads)
    if len(batch.groups) == 1:
        return batch.groups[0].unpad(_attend(batch.groups[0], heads, masks[0], rotary))
    out = qkv.new_empty(num_tokens, hidden)
    for group, mask in zip(batch.groups, masks, strict=True):
        rows = slice(group.start, group.stop)
        group.unpad(_attend(group, heads[rows], mask, rotary), out=out[rows])
    return out


def _attend(
    group: AttentionGroup, qkv: torch.Tensor, mask: torch.Tensor | None, rotary: Rotary | None
) -> torch.Tensor:
    """One group's rows ``[n, 3, heads, head_dim]`` attended, as the group's padded block
    ``[S, L, hidden]``."""
    # [S, L, 3, heads, d] -> three [S, heads, L, d] views
    q, k, v = group.pad(qkv).permute(2, 0, 3, 1, 4).unbind(0)
    if rotary is not None:
        cos, sin = rotary
        table = (cos[: group.max_len], sin[: group.max_len])
        q, k = rotate(q, table), rotate(k, table)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # NOTE: the CPU kernel lays its output out as [S, L, heads, d] and returns it
    # transposed, so this is a view there (a copy elsewhere).
    return out.transpose(1, 2).reshape(group.num_seqs, group.max_len, -1)


def rotary_tables(theta: float, head_dim: int, length: int, device: torch.device) -> Rotary:
    """RoPE's cos and sin for positions ``0..length-1``, computed as transformers does (in
    float32, each frequency twice: the halves of a head rotate together)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """``x`` (``[..., L, head_dim]``) rotated by position, in float32, back in its dtype."""
    cos, sin = rotary
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)
