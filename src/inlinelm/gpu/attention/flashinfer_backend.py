"""FlashInfer attention on CUDA: paged NHD cache, one plan per step, one run per layer.

``flashinfer`` is imported only when this backend is built, never at package import: it
takes seconds, creates cache folders, and is absent on CPU installs. The page table comes
from :mod:`inlinelm.gpu.attention.page_table`, shared with the CPU reference
:class:`~tests.gpu.attention.page_table_oracle.PageTableAttention`; only the wrapper calls
below are specific to FlashInfer.

Its graphed decode (:class:`FlashInferGraphAttention`) uses FlashInfer's CUDA-graph decode
wrappers: one per size over shared indptr / indices / last-page-length buffers, planned on
the host before each replay.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inlinelm.gpu.attention.metadata import (
    AttentionMetadata,
    GraphPlan,
    IntArray,
    LayerAttention,
)
from inlinelm.gpu.attention.page_table import (
    PageTable,
    PageTableArrays,
    pack_page_table,
    paged_kv_view,
    step_page_table,
)
from inlinelm.gpu.kv_cache import write_kv
from inlinelm.gpu.staging import HostStaging, StagedColumn

WORKSPACE_BYTES = 128 * 1024**2
"""Float workspace shared by both wrappers (FlashInfer's recommended size, split-KV partials)."""

TENSOR_CORE_DECODE_MIN_GROUP = 4
"""Query heads per KV head from which decode runs on the tensor-core (prefill) kernel."""


@dataclass(slots=True)
class _FlashInferPlan:
    # NOTE: the table is kept with the plan: the wrapper reads its device buffer in run().
    table: PageTable
    wrapper: Any


class FlashInferAttention:
    """Attention with FlashInfer's FA2 kernels over the paged cache (CUDA only).

    A step with any prefill chunk runs ``BatchPrefillWithPagedKVCacheWrapper`` (ragged
    queries, paged keys, bottom-right causal); a pure decode step runs
    ``BatchDecodeWithPagedKVCacheWrapper``. ``prepare`` plans once per step; ``forward``
    writes the layer's new K/V through the slot mapping and runs the planned wrapper.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        import flashinfer

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.dtype = dtype
        self.device = device
        # NOTE: zeroed before first use, as FlashInfer requires; the two wrappers never run
        # in the same step, so they share it.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2"
        )
        self._decode: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_tensor_cores=num_heads // num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP,
            backend="fa2",
        )
        self._planned: Any = None  # a torch.cuda.Event recorded after the last plan

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Build the page table and plan the step's wrapper, once for all layers."""
        table = step_page_table(meta, block_size, self.device)
        # NOTE: plan() stages through the wrapper's pinned host buffer with an async copy:
        # with a step in flight (the pipelined runner), the previous plan's copy must land
        # before that buffer is rewritten. It is early in the previous step: a short wait.
        if self._planned is not None:
            self._planned.synchronize()
        self._plan(table, block_size)
        meta.plan = _FlashInferPlan(table, self._decode if table.is_decode else self._prefill)
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch stub
            self._planned.record()

    def _plan(self, table: PageTable, block_size: int) -> None:
        host, device = table.host, table.device
        # NOTE: plan() reads the indptrs on the host (a device indptr would cost a sync)
        # and the page ids on the device; every optional argument goes by keyword.
        if table.is_decode:
            self._decode.plan(
                host.kv_indptr,
                device.kv_indices,
                host.kv_last_page_len,
                *self.plan_shape(block_size),
                **self.plan_options(),
            )
            return
        self._prefill.plan(
            host.qo_indptr,
            host.kv_indptr,
            device.kv_indices,
            host.kv_last_page_len,
            *self.plan_shape(block_size),
            causal=True,
            **self.plan_options(),
        )

    def plan_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """The positional shape arguments every wrapper's ``plan`` takes after the table."""
        return self.num_heads, self.num_kv_heads, self.head_dim, block_size

    def plan_options(self) -> dict[str, Any]:
        """The keyword arguments every wrapper's ``plan`` takes (RoPE is the model's)."""
        return {
            "pos_encoding_mode": "NONE",
            "sm_scale": self.scale,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
            "non_blocking": True,
        }

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """See :class:`~inlinelm.gpu.attention.metadata.AttentionBackend`."""
        plan = meta.plan
        assert isinstance(plan, _FlashInferPlan)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        pages = paged_kv_view(kv_cache, plan.table.page_size)
        # NOTE: q is a head slice of the fused QK tensor. The decode kernels take its row
        # and head strides (only the last dimension must be dense); prefill gets it dense.
        if not plan.table.is_decode:
            q = q.contiguous()
        out: torch.Tensor = plan.wrapper.run(q, pages)
        return out

    def make_graph_attention(
        self, max_batch_size: int, max_model_len: int, block_size: int, device: torch.device
    ) -> FlashInferGraphAttention:
        """See :class:`~inlinelm.gpu.attention.metadata.AttentionBackend`."""
        max_blocks = -(-max_model_len // block_size)
        return FlashInferGraphAttention(self, max_batch_size, max_blocks, block_size, device)


class FlashInferGraphAttention:
    """FlashInfer's CUDA-graph decode wrappers, one per size, over shared static buffers."""

    def __init__(
        self,
        backend: FlashInferAttention,
        max_batch_size: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        max_bs = self.max_batch_size = max_batch_size
        self.backend = backend
        self.block_size = block_size
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_bs * max_blocks, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # int64 views of the step for AttentionMetadata (FlashInfer reads only the plan).
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.no_block_tables = torch.zeros(max_bs, 0, dtype=torch.int64, device=device)
        self.wrappers: dict[int, Any] = {}
        self._planned: torch.cuda.Event | None = None

    def init_capture_graph(self, sizes: list[int]) -> None:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`: one CUDA-graph
        decode wrapper per size, over prefixes of the shared buffers."""
        import flashinfer

        b = self.backend
        tensor_cores = b.num_heads // b.num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP
        # NOTE: the float workspace is the eager backend's: steps run one at a time, in order.
        self.wrappers = {
            size: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                b._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tensor_cores,
                backend="fa2",
                paged_kv_indptr_buffer=self.indptr[: size + 1],
                paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_page_len[:size],
            )
            for size in sizes
        }

    def prepare_for_replay(
        self, size: int, seq_lens: IntArray, block_tables: IntArray, staging: HostStaging
    ) -> GraphPlan:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`."""
        query_start_loc = np.arange(size + 1, dtype=np.int64)
        lens = staging.add(seq_lens, np.int64)
        packed = staging.add(
            pack_page_table(query_start_loc, seq_lens, block_tables, self.block_size), np.int32
        )
        return functools.partial(self._plan, size, lens, packed)

    def _plan(self, size: int, lens: StagedColumn, packed: StagedColumn) -> None:
        # NOTE: plan() stages through a pinned host buffer with an async copy: with a step
        # in flight, the copy of the previous plan must land before that buffer is rewritten.
        if self._planned is not None:
            self._planned.synchronize()
        self.seq_lens[:size].copy_(lens.get(), non_blocking=True)
        host = PageTableArrays.unpack(packed.host(), size)
        # NOTE: the page ids are read on the device (already there: a device-to-device copy
        # into the static buffer); indptr and last-page lengths FlashInfer copies from our
        # pinned host views without blocking.
        on_device = PageTableArrays.unpack(packed.get(), size)
        b = self.backend
        self.wrappers[size].plan(
            host.kv_indptr,
            on_device.kv_indices,
            host.kv_last_page_len,
            *b.plan_shape(self.block_size),
            **b.plan_options(),
        )
        self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch stub
        self._planned.record()

    def prepare_for_capture(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`."""
        arrays = PageTableArrays(
            qo_indptr=self.qo_indptr[: size + 1],
            kv_indptr=self.indptr[: size + 1],
            kv_last_page_len=self.last_page_len[:size],
            kv_indices=self.indices,
        )
        table = PageTable(self.block_size, size, True, host=arrays, device=arrays)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.no_block_tables[:size],
            max_query_len=1,
            max_seq_len=0,
            plan=_FlashInferPlan(table, self.wrappers[size]),
        )

    def close(self) -> None:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`."""
        self.wrappers.clear()
