"""The pure-torch attention backend (CPU, and the reference on CUDA).

One forward carries the flattened tokens of many sequences (prefill chunks and decode
tokens mixed). Each layer writes its new K/V into the paged cache at ``slot_mapping`` and
attends over the sequence's whole context through its block table.

Its graphed decode (:class:`TorchGraphAttention`) gathers every row's whole static block
table and masks keys past its length: static shapes, so it captures too, at a cost that
grows with ``max_model_len`` (it is the fallback). On a CPU the same static-buffer step
runs eagerly, so the padding and buffer plumbing are tested without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from inlinelm.gpu.attention.metadata import (
    AttentionMetadata,
    GraphPlan,
    IntArray,
    LayerAttention,
)
from inlinelm.gpu.attention.torch_plan import Chunk, DecodeGroup, Plan
from inlinelm.gpu.kv_cache import write_kv
from inlinelm.gpu.staging import HostStaging

DECODE_GROUP_SIZE = 8
"""Decode rows per SDPA call (rows are sorted by context length first)."""

SERIAL_DECODE_MAX_KEYS = 1024
"""A lone decode row with at most this many keys is attended on one intra-op thread: its
gather and SDPA split badly (measured, 2 cores: 49 µs on one thread against 84 µs on two
at 170 keys, and no gain from two up to 4000 keys; two rows or more gain from two)."""

TORCH_GRAPH_MAX_KEYS = 1 << 20
"""Keys one layer of :class:`TorchGraphAttention` gathers at the largest size (rows times
``max_model_len``): it caps the torch backend's largest graph (its pool holds that gather)."""


class TorchAttention:
    """CPU attention over the paged cache with torch's SDPA.

    Decode tokens share SDPA calls, up to eight sequences of similar length per call; each
    prefill chunk gets its own
    (causal, or bottom-right causal when part of its context is cached), so no sequence is
    padded to the longest one. The context is gathered a block at a time. The Python loop
    runs over prefill chunks of a step (bounded by the token budget), never over tokens.

    With ``cpu_ops`` (the CPU extension, for a float32 model; see
    :func:`~inlinelm.gpu.model.cpu_extension.cpu_ops`) the KV write and every decode group
    are one call each: the kernel reads the keys in place through the block table (no
    gather, no mask) and splits heads over threads only when the work gains from it.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, cpu_ops: Any = None
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cpu_ops = cpu_ops

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Split the step into decode groups and prefill chunks."""
        # NOTE: the host copies when the runner passed them: on CUDA, .tolist() of a device
        # tensor would wait for the step in flight.
        starts = _host_list(meta.host_query_start_loc, meta.query_start_loc)
        seq_lens = _host_list(meta.host_seq_lens, meta.seq_lens)
        single = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        chunks = [
            self._chunk(meta, i, starts[i], starts[i + 1], seq_lens[i], block_size)
            for i in range(len(seq_lens))
            if starts[i + 1] - starts[i] > 1
        ]
        if self.cpu_ops is not None:
            # NOTE: the kernel reads each row's own length through its block table: one
            # call for every decode row of the step, no masks.
            whole = not chunks and single == list(range(len(seq_lens)))
            index = slice(0, len(single)) if whole else torch.tensor(single, dtype=torch.long)
            group = DecodeGroup(
                meta.query_start_loc[index],
                meta.block_tables[index],
                None,
                meta.seq_lens[index],
            )
            meta.plan = Plan(block_size, [group] if single else [], chunks, whole and bool(single))
            return
        # NOTE: decode rows sorted by length and batched in groups, so short contexts are not
        # gathered and attended at the longest one's length.
        single.sort(key=lambda i: seq_lens[i])
        whole = (
            not chunks
            and 0 < len(single) <= DECODE_GROUP_SIZE
            and single == list(range(len(single)))
        )
        if whole:
            decode = [self._decode_group(meta, slice(0, len(single)), seq_lens, block_size)]
        else:
            decode = self._decode_groups(meta, single, seq_lens, block_size)
        meta.plan = Plan(block_size, decode, chunks, whole)

    def _decode_groups(
        self, meta: AttentionMetadata, single: list[int], seq_lens: list[int], block_size: int
    ) -> list[DecodeGroup]:
        """Groups of the decode rows ``single`` (sorted by length) of at most eight rows."""
        if not single:
            return []
        order = _decode_order(meta)
        groups = []
        for k in range(0, len(single), DECODE_GROUP_SIZE):
            rows = single[k : k + DECODE_GROUP_SIZE]
            lens = [seq_lens[i] for i in rows]
            groups.append(self._decode_group(meta, order[k : k + len(rows)], lens, block_size))
        return groups

    def _decode_group(
        self,
        meta: AttentionMetadata,
        index: torch.Tensor | slice,
        lens: list[int],
        block_size: int,
    ) -> DecodeGroup:
        """The group of decode rows ``index`` (device positions, or a slice) of lengths ``lens``."""
        device = meta.seq_lens.device
        num_blocks = -(-max(lens) // block_size)
        key_mask = None
        if min(lens) != num_blocks * block_size:
            positions = torch.arange(num_blocks * block_size, device=device)
            key_mask = (positions.view(1, -1) < meta.seq_lens[index].view(-1, 1)).view(
                len(lens), 1, 1, -1
            )
        return DecodeGroup(
            meta.query_start_loc[index],
            meta.block_tables[index, :num_blocks],
            key_mask,
            meta.seq_lens[index],
            serial=len(lens) == 1 and num_blocks * block_size <= SERIAL_DECODE_MAX_KEYS,
        )

    def _chunk(
        self, meta: AttentionMetadata, row: int, start: int, end: int, seq_len: int, block_size: int
    ) -> Chunk:
        num_blocks = -(-seq_len // block_size)
        query_len = end - start
        mask = None
        if seq_len != query_len:
            device = meta.seq_lens.device
            q_pos = torch.arange(seq_len - query_len, seq_len, device=device).view(-1, 1)
            mask = torch.arange(seq_len, device=device).view(1, -1) <= q_pos
        return Chunk(start, end, seq_len, meta.block_tables[row, :num_blocks], mask)

    def whole_decode(
        self, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The block tables, context lengths and block size of a prepared step whose every
        row is a decode row attended by the CPU extension (one ``paged_decode`` call a
        layer, as a fused decode step makes it), else None."""
        plan = meta.plan
        if self.cpu_ops is None or not isinstance(plan, Plan) or not plan.whole:
            return None
        group = plan.decode[0]
        return group.block_tables, group.seq_lens, plan.block_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """See :class:`AttentionBackend`."""
        plan = meta.plan
        assert isinstance(plan, Plan)
        if self.cpu_ops is not None:
            self.cpu_ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        else:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        blocks = kv_cache.view(2, -1, plan.block_size, self.num_kv_heads, self.head_dim)
        attend = self._attend_paged if self.cpu_ops is not None else self._attend_decode
        if plan.whole:  # a decode-only step (the common case): no gather of q, no scatter
            return attend(q, kv_cache, blocks, plan.decode[0], layer)
        out = torch.empty_like(q)
        for group in plan.decode:
            rows = group.token_index
            out[rows] = attend(q[rows], kv_cache, blocks, group, layer)
        for chunk in plan.chunks:
            self._attend_chunk(q, blocks, chunk, out, layer)
        return out

    def _attend_paged(
        self,
        queries: torch.Tensor,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        group: DecodeGroup,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """:meth:`_attend_decode` through the CPU extension's kernel, over the cache itself."""
        out: torch.Tensor = self.cpu_ops.paged_decode(
            queries,
            kv_cache,
            group.block_tables,
            group.seq_lens,
            blocks.shape[2],
            layer.scale,
            layer.sliding_window or 0,
            layer.softcap or 0.0,
        )
        return out

    def _attend_decode(
        self,
        queries: torch.Tensor,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        group: DecodeGroup,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """Attention of one decode group; ``queries`` are its rows [Bd, H, D] (SDPA over the
        gathered ``blocks``; ``kv_cache`` is there for :meth:`_attend_paged`'s signature)."""
        if group.serial and (threads := torch.get_num_threads()) > 1:
            torch.set_num_threads(1)
            try:
                return self._decode_sdpa(queries, blocks, group, layer)
            finally:
                torch.set_num_threads(threads)
        return self._decode_sdpa(queries, blocks, group, layer)

    def _decode_sdpa(
        self,
        queries: torch.Tensor,
        blocks: torch.Tensor,
        group: DecodeGroup,
        layer: LayerAttention,
    ) -> torch.Tensor:
        count = queries.shape[0]
        keys = (
            blocks[0][group.block_tables]
            .view(count, -1, self.num_kv_heads, self.head_dim)
            .transpose(1, 2)
            .to(queries.dtype)
        )
        values = (
            blocks[1][group.block_tables]
            .view(count, -1, self.num_kv_heads, self.head_dim)
            .transpose(1, 2)
            .to(queries.dtype)
        )
        mask = group.mask(layer.sliding_window, keys.shape[2])
        result = attend(queries.unsqueeze(2), keys, values, mask, layer)  # [Bd, H, 1, D]
        return result.squeeze(2)

    def _attend_chunk(
        self,
        q: torch.Tensor,
        blocks: torch.Tensor,
        chunk: Chunk,
        out: torch.Tensor,
        layer: LayerAttention,
    ) -> None:
        keys = blocks[0][chunk.block_table].view(1, -1, self.num_kv_heads, self.head_dim)[
            :, : chunk.seq_len
        ]
        values = blocks[1][chunk.block_table].view(1, -1, self.num_kv_heads, self.head_dim)[
            :, : chunk.seq_len
        ]
        queries = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        # NOTE: a narrower cache (kv_cache_dtype) is widened to the queries' dtype here
        keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
        if layer.sliding_window is None and layer.softcap is None:
            result = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=layer.scale,
                enable_gqa=True,
            )
        else:
            mask = chunk.explicit_mask(layer.sliding_window)
            result = attend(queries, keys, values, mask, layer)
        out[chunk.start : chunk.end] = result[0].transpose(0, 1)

    def make_graph_attention(
        self, max_batch_size: int, max_model_len: int, block_size: int, device: torch.device
    ) -> TorchGraphAttention:
        """See :class:`~inlinelm.gpu.attention.metadata.AttentionBackend`; the largest size
        is capped so that one layer gathers at most :data:`TORCH_GRAPH_MAX_KEYS` keys."""
        max_blocks = -(-max_model_len // block_size)
        largest = max(1, min(max_batch_size, TORCH_GRAPH_MAX_KEYS // (max_blocks * block_size)))
        return TorchGraphAttention(largest, max_blocks, block_size, device)


class TorchGraphAttention:
    """Static-shape decode for :class:`TorchAttention`: every row gathers its whole static
    block table, keys past its length masked (see the module docstring)."""

    def __init__(
        self, max_batch_size: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.block_tables = torch.zeros(
            max_batch_size, max_blocks, dtype=torch.int64, device=device
        )
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int64, device=device)
        self.rows = torch.arange(max_batch_size + 1, dtype=torch.int64, device=device)
        self.key_positions = torch.arange(max_blocks * block_size, device=device)

    def init_capture_graph(self, sizes: list[int]) -> None:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`: every size shares
        the buffers made with the object."""

    def prepare_for_replay(
        self, size: int, seq_lens: IntArray, block_tables: IntArray, staging: HostStaging
    ) -> GraphPlan:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`."""
        width = block_tables.shape[1]
        lens, tables = staging.add(seq_lens, np.int64), staging.add(block_tables, np.int64)

        def plan() -> None:
            # NOTE: columns past ``width`` keep older block ids: valid indices, masked out.
            self.seq_lens[:size].copy_(lens.get(), non_blocking=True)
            self.block_tables[:size, :width].copy_(tables.get(), non_blocking=True)

        return plan

    def prepare_for_capture(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`."""
        seq_lens, tables = self.seq_lens[:size], self.block_tables[:size]
        # NOTE: computed from the static lengths inside the graph, so each replay masks anew.
        key_mask = (self.key_positions.view(1, -1) < seq_lens.view(-1, 1)).view(size, 1, 1, -1)
        group = DecodeGroup(self.rows[:size], tables, key_mask, seq_lens)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=self.rows[: size + 1],
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=1,
            max_seq_len=int(self.key_positions.numel()),
            plan=Plan(self.block_size, [group], [], whole=True),
        )

    def close(self) -> None:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`."""


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    layer: LayerAttention,
) -> torch.Tensor:
    """``layer``'s attention of ``queries`` [B, H, q, D] over ``keys``/``values``
    [B, KVH, k, D] where ``mask`` (broadcast to [B, H, q, k]; None: all) is True.

    Without a soft cap it is torch's SDPA; with one, the eager computation transformers
    runs (scaled products, ``cap * tanh(s / cap)``, the mask, a float32 softmax), which
    SDPA cannot express.
    """
    if layer.softcap is None:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=True
        )
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values)


def _decode_order(meta: AttentionMetadata) -> torch.Tensor:
    """Rows with one query token, shortest context first (ties by row), then the others:
    on the device, the order :meth:`TorchAttention.prepare` sorts the host lists in, so
    no row index list is copied over."""
    starts = meta.query_start_loc
    single = (starts[1:] - starts[:-1]) == 1
    key = torch.where(single, meta.seq_lens, torch.iinfo(meta.seq_lens.dtype).max)
    return torch.argsort(key, stable=True)


def _host_list(host: IntArray | None, device: torch.Tensor) -> list[int]:
    values: list[int] = host.tolist() if host is not None else device.tolist()
    return values
