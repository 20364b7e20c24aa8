"""Pure-torch attention that reads only the page table: the CPU twin of the FlashInfer backend.

It sees the step exactly as FlashInfer's wrappers do (``qo_indptr``, ``kv_indptr``,
``kv_indices``, ``kv_last_page_len`` and the cache as NHD pages), so holding it equal to
:class:`~inlinelm.gpu.attention.torch_backend.TorchAttention` proves the page-table builder, the cache
view, the K/V write, and the window and soft cap as FlashInfer is told them, without a
GPU. It is a reference, not a fast path: one attention call per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inlinelm.gpu.attention.flashinfer_backend import layer_plan_options
from inlinelm.gpu.attention.metadata import AttentionMetadata, LayerAttention
from inlinelm.gpu.attention.page_table import PageTable, paged_kv_view, step_page_table
from inlinelm.gpu.kv_cache import write_kv


class PageTableAttention:
    """Attention over the paged cache through FlashInfer's page-table form, in torch."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Build the step's page table (see :func:`~inlinelm.gpu.attention.page_table.build_page_table`)."""
        meta.plan = step_page_table(meta, block_size, meta.slot_mapping.device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """See :class:`~inlinelm.gpu.attention.metadata.AttentionBackend`: ``layer`` as the
        FlashInfer backend hands it to FlashInfer (:func:`layer_plan_options`)."""
        table = meta.plan
        assert isinstance(table, PageTable)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_pages, v_pages = paged_kv_view(kv_cache, table.page_size)
        return paged_attention(q, k_pages, v_pages, table, **layer_plan_options(layer))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: PageTable,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of ``q`` [T, H, D] over NHD pages, reading only ``table.device``,
    with FlashInfer's ``plan()`` options in its own terms.

    Causal is bottom-right aligned, as FlashInfer's ``causal=True``: query ``j`` of a
    request with ``q_len`` queries and ``kv_len`` keys sees keys ``0 .. kv_len - q_len + j``.
    ``window_left >= 0`` also hides key ``k`` unless ``k + q_len + window_left >= kv_len +
    j`` (FlashInfer's ``DefaultAttention`` mask, ``attention/variants.cuh``), ``-1`` hides
    none. ``logits_soft_cap > 0`` caps the scaled products at ``cap * tanh(s / cap)``.
    """
    arrays = table.device
    qo_indptr = arrays.qo_indptr.tolist()
    kv_indptr = arrays.kv_indptr.tolist()
    last_page_len = arrays.kv_last_page_len.tolist()
    out = torch.empty_like(q)
    for i in range(table.batch_size):
        pages = arrays.kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * table.page_size + last_page_len[i]
        keys = k_pages[pages].flatten(0, 1)[:kv_len]  # [kv_len, KVH, D]
        values = v_pages[pages].flatten(0, 1)[:kv_len]
        queries = q[qo_indptr[i] : qo_indptr[i + 1]]  # [q_len, H, D]
        q_len = queries.shape[0]
        kv_idx = torch.arange(kv_len, device=q.device).view(1, -1)
        qo_idx = torch.arange(q_len, device=q.device).view(-1, 1)
        visible = kv_idx <= kv_len - q_len + qo_idx
        if window_left >= 0:
            visible &= kv_idx + q_len + window_left >= kv_len + qo_idx
        result = _attend(
            queries.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            visible,
            sm_scale,
            logits_soft_cap,
        )
        out[qo_indptr[i] : qo_indptr[i + 1]] = result[0].transpose(0, 1)
    return out


def _attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    logits_soft_cap: float,
) -> torch.Tensor:
    """[1, H, q, D] queries over [1, KVH, k, D] keys where ``visible`` [q, k] holds."""
    if logits_soft_cap <= 0:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible, scale=sm_scale, enable_gqa=True
        )
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * sm_scale
    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(weights, values.float()).to(queries.dtype)
