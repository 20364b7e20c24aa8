"""FlashInfer attention on CUDA: paged NHD cache, one plan per layer kind per step, one run
per layer.

``flashinfer`` is imported only when this backend is built, never at package import: it
takes seconds, creates cache folders, and is absent on CPU installs. The page table comes
from :mod:`inlinelm.gpu.attention.page_table`, shared with the CPU reference
:class:`~tests.gpu.attention.page_table_oracle.PageTableAttention`; only the wrapper calls
below are specific to FlashInfer.

FlashInfer compiles a layer's window and soft cap into the kernel its ``plan()`` picks
(the module names carry ``use_swa`` and ``use_logits_cap``), so every distinct
:class:`~inlinelm.gpu.attention.metadata.LayerAttention` of a model (Gemma's sliding and
global layers) has wrappers of its own, each planned once per step over the same page
table. The float workspace is shared by all of them: ``plan()`` only lays out offsets in
it, and each ``run()`` writes its split-KV partials there and merges them before the next
run starts on the stream (SGLang's sliding-window and full wrappers share one the same
way). Each wrapper keeps its own int workspace, where ``plan()`` writes the step's
schedule: two kinds planned for one step must not share that.

Its graphed decode (:class:`FlashInferGraphAttention`) uses FlashInfer's CUDA-graph decode
wrappers: one per size per kind over shared indptr / indices / last-page-length buffers,
each kind's planned on the host before each replay.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
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
"""Float workspace shared by every wrapper (FlashInfer's recommended size, split-KV partials)."""

INT_WORKSPACE_BYTES = 8 * 1024**2
"""Int workspace of one kind's graph wrappers, shared by all sizes (FlashInfer's size)."""

TENSOR_CORE_DECODE_MIN_GROUP = 4
"""Query heads per KV head from which decode runs on the tensor-core (prefill) kernel."""


def layer_plan_options(layer: LayerAttention) -> dict[str, float | int]:
    """``layer``'s ``plan()`` keywords in FlashInfer's terms.

    FlashInfer's ``window_left`` is the query's distance to the oldest key it sees (the
    key at ``j`` is visible to the query at ``i`` when ``i - window_left <= j <= i``;
    -1: all), so a window of ``w`` keys, the query's own included, is ``w - 1``. A
    ``logits_soft_cap`` of 0.0 is none; ``sm_scale`` multiplies the products first, the
    cap applies to the scaled products (``cap * tanh(s / cap)``), as ours.
    """
    # NOTE: plain floats and ints whatever the config held: they cross into C++ as double
    # and int64 (a numpy scalar or an int cap would not be a double).
    return {
        "sm_scale": float(layer.scale),
        "window_left": -1 if layer.sliding_window is None else int(layer.sliding_window) - 1,
        "logits_soft_cap": 0.0 if layer.softcap is None else float(layer.softcap),
    }


def distinct_kinds(layers: Sequence[LayerAttention]) -> tuple[LayerAttention, ...]:
    """The distinct kinds of ``layers`` in order; ValueError for none, or for a window
    or soft cap FlashInfer cannot take (a window under one key, a cap not above 0)."""
    kinds = tuple(dict.fromkeys(layers))
    if not kinds:
        raise ValueError("FlashInferAttention needs the attention kind of at least one layer")
    for kind in kinds:
        if kind.sliding_window is not None and kind.sliding_window < 1:
            raise ValueError(f"a sliding window holds at least one key, not {kind}")
        if kind.softcap is not None and not kind.softcap > 0:
            raise ValueError(f"a soft cap is above 0, not {kind}")
    return kinds


@dataclass(slots=True)
class _FlashInferPlan:
    # NOTE: the table is kept with the plan: the wrappers read its device buffer in run().
    table: PageTable
    wrappers: Mapping[LayerAttention, Any]  # each kind's wrapper, planned for this step

    def wrapper(self, layer: LayerAttention) -> Any:
        """The wrapper planned for ``layer``'s kind; ValueError for a kind not planned."""
        wrapper = self.wrappers.get(layer)
        if wrapper is None:
            raise ValueError(
                f"no FlashInfer plan for {layer}: the backend was built for {list(self.wrappers)}"
            )
        return wrapper


class FlashInferAttention:
    """Attention with FlashInfer's FA2 kernels over the paged cache (CUDA only).

    A step with any prefill chunk runs ``BatchPrefillWithPagedKVCacheWrapper`` (ragged
    queries, paged keys, bottom-right causal); a pure decode step runs
    ``BatchDecodeWithPagedKVCacheWrapper``. ``layers`` are the kinds of the model's
    layers (repeats are fine): each distinct kind gets a wrapper of each sort. ``prepare``
    plans every kind once per step; ``forward`` writes the layer's new K/V through the
    slot mapping and runs its kind's wrapper (a kind not in ``layers`` is a ValueError).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layers: Sequence[LayerAttention],
    ) -> None:
        import flashinfer

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.kinds = distinct_kinds(layers)
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP
        # NOTE: zeroed before first use, as FlashInfer requires; shared (module docstring).
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = {kind: self._prefill_wrapper(flashinfer) for kind in self.kinds}
        self._decode = {kind: self._decode_wrapper(flashinfer) for kind in self.kinds}
        self._planned: Any = None  # a torch.cuda.Event recorded after the last plan

    def _prefill_wrapper(self, flashinfer: Any) -> Any:
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")

    def _decode_wrapper(self, flashinfer: Any) -> Any:
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend="fa2"
        )

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Build the page table and plan the step's wrapper of every kind, once for all
        layers."""
        table = step_page_table(meta, block_size, self.device)
        # NOTE: plan() stages through the wrapper's pinned host buffer with an async copy:
        # with a step in flight (the pipelined runner), the previous plan's copy must land
        # before that buffer is rewritten. It is early in the previous step: a short wait.
        if self._planned is not None:
            self._planned.synchronize()
        wrappers = self._decode if table.is_decode else self._prefill
        for kind, wrapper in wrappers.items():
            self._plan(wrapper, table, block_size, kind)
        meta.plan = _FlashInferPlan(table, wrappers)
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch stub
            self._planned.record()

    def _plan(self, wrapper: Any, table: PageTable, block_size: int, kind: LayerAttention) -> None:
        host, device = table.host, table.device
        # NOTE: plan() reads the indptrs on the host (a device indptr would cost a sync)
        # and the page ids on the device; every optional argument goes by keyword.
        if table.is_decode:
            wrapper.plan(
                host.kv_indptr,
                device.kv_indices,
                host.kv_last_page_len,
                *self.plan_shape(block_size),
                **self.plan_options(kind),
            )
            return
        wrapper.plan(
            host.qo_indptr,
            host.kv_indptr,
            device.kv_indices,
            host.kv_last_page_len,
            *self.plan_shape(block_size),
            causal=True,
            **self.plan_options(kind),
        )

    def plan_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """The positional shape arguments every wrapper's ``plan`` takes after the table."""
        return self.num_heads, self.num_kv_heads, self.head_dim, block_size

    def plan_options(self, kind: LayerAttention) -> dict[str, Any]:
        """The keyword arguments every wrapper's ``plan`` takes for layers of ``kind``
        (RoPE is the model's)."""
        return {
            "pos_encoding_mode": "NONE",
            **layer_plan_options(kind),
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
        wrapper = plan.wrapper(layer)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        pages = paged_kv_view(kv_cache, plan.table.page_size)
        # NOTE: q is a head slice of the fused QK tensor. The decode kernels take its row
        # and head strides (only the last dimension must be dense); prefill gets it dense.
        if not plan.table.is_decode:
            q = q.contiguous()
        out: torch.Tensor = wrapper.run(q, pages)
        return out

    def make_graph_attention(
        self, max_batch_size: int, max_model_len: int, block_size: int, device: torch.device
    ) -> FlashInferGraphAttention:
        """See :class:`~inlinelm.gpu.attention.metadata.AttentionBackend`."""
        max_blocks = -(-max_model_len // block_size)
        return FlashInferGraphAttention(self, max_batch_size, max_blocks, block_size, device)


class FlashInferGraphAttention:
    """FlashInfer's CUDA-graph decode wrappers, one per size per kind, over shared static
    buffers.

    Every kind's wrapper of a size is planned before each replay over the same page
    table (the plans copy the same table into the shared buffers). The wrappers of one
    kind share one int workspace: a step plans and replays one size only, in stream
    order, so the sizes never need theirs at once; the kinds of one step each keep
    their own (module docstring).
    """

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
        self.device = device
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_bs * max_blocks, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # int64 views of the step for AttentionMetadata (FlashInfer reads only the plan).
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.no_block_tables = torch.zeros(max_bs, 0, dtype=torch.int64, device=device)
        self.wrappers: dict[int, dict[LayerAttention, Any]] = {}  # size -> kind -> wrapper
        self.int_workspaces: dict[LayerAttention, torch.Tensor] = {}
        self._planned: torch.cuda.Event | None = None

    def init_capture_graph(self, sizes: list[int]) -> None:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`: one CUDA-graph
        decode wrapper per size and kind, over prefixes of the shared buffers."""
        import flashinfer

        self.int_workspaces = {
            kind: torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            for kind in self.backend.kinds
        }
        self.wrappers = {
            size: {kind: self._wrapper(flashinfer, size, kind) for kind in self.backend.kinds}
            for size in sizes
        }

    def _wrapper(self, flashinfer: Any, size: int, kind: LayerAttention) -> Any:
        b = self.backend
        # NOTE: the float workspace is the eager backend's: steps run one at a time, in order.
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            b._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=b.use_tensor_cores,
            backend="fa2",
            paged_kv_indptr_buffer=self.indptr[: size + 1],
            paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len[:size],
        )
        # NOTE: the wrapper's own int workspace (8 MiB) goes back to the caching allocator
        # for the next one: a kind holds one, not one per size (35 sizes, several kinds).
        wrapper.reset_workspace_buffer(b._workspace, self.int_workspaces[kind])
        return wrapper

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
        for kind, wrapper in self.wrappers[size].items():
            wrapper.plan(
                host.kv_indptr,
                on_device.kv_indices,
                host.kv_last_page_len,
                *b.plan_shape(self.block_size),
                **b.plan_options(kind),
            )
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch stub
            self._planned.record()

    def prepare_for_capture(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """See :class:`~inlinelm.gpu.attention.metadata.GraphAttention`: its plan gives
        each layer its kind's wrapper of ``size``."""
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
        self.int_workspaces.clear()
