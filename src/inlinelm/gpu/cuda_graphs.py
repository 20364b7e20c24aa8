"""CUDA graphs for decode steps: one unit, in the shape of mini-sglang's ``GraphRunner``.

- :func:`capture_sizes` is the one place batch sizes are picked (1, 2, 4, 8, then every 8).
- :class:`DecodeGraphs` owns static input buffers sized for the largest batch, allocated
  once and only ever written with ``copy_``. It captures the largest size first, all sizes
  into one shared memory pool, after an eager warm-up of each size.
- A step with ``n`` rows runs the graph of the smallest size ``>= n``; the rows past ``n``
  are padding: token 0 at position 0, one key, written to a scratch block that the block
  pool never hands out (the cache holds one block more than the pool).
- :meth:`DecodeGraphs.can_replay` holds every eager fallback; :meth:`DecodeGraphs.close`
  releases the graphs.
- Every graph writes its logits into one static ``[max size, V]`` buffer, so the pool
  holds one size's logits, not one per size.
- Sampling stays outside the graph (per-request generators, logprobs, penalties).
- The CUDA calls of a capture sit behind :class:`GraphCapture`: :class:`CudaGraphCapture`
  on a device, :class:`EagerCapture` on a CPU, where a "replay" runs the step again, so
  everything else here runs in the CPU tests.

Attention inside a graph reads only static buffers. :class:`FlashInferGraphAttention` uses
FlashInfer's CUDA-graph decode wrappers (one per size over shared indptr / indices /
last-page-length buffers, planned on the host before each replay).
:class:`TorchGraphAttention` gathers every row's whole static block table and masks keys past
its length: static shapes, so it captures too, at a cost that grows with ``max_model_len``
(it is the fallback). On a CPU the same static-buffer step runs eagerly (``capture=False``),
so the padding and buffer plumbing are tested without a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata, IntArray
from inlinelm.gpu.attention.page_table import PageTable, PageTableArrays, pack_page_table
from inlinelm.gpu.attention.torch_backend import TorchAttention, _DecodeGroup, _Plan
from inlinelm.gpu.input_batch import StepInputs
from inlinelm.gpu.staging import HostStaging, StagedColumn

TORCH_GRAPH_MAX_KEYS = 1 << 20
"""Keys one layer of :class:`TorchGraphAttention` gathers at the largest size (rows times
``max_model_len``): it caps the torch backend's largest graph (its pool holds that gather)."""

FillPending = Callable[[torch.Tensor], None]
"""Writes the tokens sampled by steps in flight into a step's ``input_ids`` (on the device)."""

Plan = Callable[[], None]
"""Loads a staged step into the graph attention's static buffers, once the staging is sent."""


def capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8, and ``max_batch_size`` itself."""
    sizes = {s for s in (1, 2, 4) if s <= max_batch_size}
    sizes.update(range(8, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


Replay = Callable[[], None]
"""Runs a captured step again over the static buffers' current contents."""


class GraphCapture(Protocol):
    """Turns a step over static buffers into a :data:`Replay` (the device-only seam)."""

    def capture(self, step: Callable[[], None]) -> Replay:
        """Warm ``step`` up and capture it; the result replays it."""
        ...

    def finish(self) -> None:
        """After the last capture: wait for the device."""
        ...


class EagerCapture:
    """:class:`GraphCapture` without CUDA: a replay runs the step eagerly (the CPU path)."""

    def capture(self, step: Callable[[], None]) -> Replay:
        """See :class:`GraphCapture`."""
        return step

    def finish(self) -> None:
        """See :class:`GraphCapture`."""


class CudaGraphCapture:
    """CUDA graphs: warm-up and capture on the device's capture stream, one shared pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = capture_stream(device)

    def capture(self, step: Callable[[], None]) -> Replay:
        """See :class:`GraphCapture`."""
        stream = self.stream
        # 1) warm up on the capture stream: lazy inits must not land in the graph
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        # 2) capture; thread_local: another thread's CUDA call cannot invalidate it
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"
        ):
            step()
        return graph.replay

    def finish(self) -> None:
        """See :class:`GraphCapture`."""
        torch.cuda.synchronize(self.device)


_CAPTURE_STREAMS: dict[torch.device, Any] = {}
"""NOTE: process-wide on purpose. cuBLAS keeps one workspace per (handle, stream) until the
process ends (32 MiB and more on sm_90); a new capture stream per engine would leave one
behind every time an engine closes."""


def capture_stream(device: torch.device) -> Any:
    """The one capture stream of CUDA ``device``, made on first use."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch stub
        _CAPTURE_STREAMS[device] = stream
    return stream


class GraphAttention(Protocol):
    """Attention of a graphed decode step: static metadata, planned outside the graph."""

    def stage(
        self, size: int, seq_lens: IntArray, block_tables: IntArray, staging: HostStaging
    ) -> Plan:
        """Stage a padded step (``size`` rows); the result loads it into the static buffers
        once the staging is sent (never captured)."""
        ...

    def metadata(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """The metadata layers read, built from static buffers (runs inside the capture)."""
        ...

    def close(self) -> None:
        """Drop wrappers and buffers."""
        ...


class TorchGraphAttention:
    """Static-shape decode for :class:`~inlinelm.gpu.attention.torch_backend.TorchAttention`."""

    def __init__(
        self, max_batch_size: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.block_tables = torch.zeros(
            max_batch_size, max_blocks, dtype=torch.int64, device=device
        )
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int64, device=device)
        self.rows = torch.arange(max_batch_size + 1, dtype=torch.int64, device=device)
        self.key_positions = torch.arange(max_blocks * block_size, device=device)

    def stage(
        self, size: int, seq_lens: IntArray, block_tables: IntArray, staging: HostStaging
    ) -> Plan:
        """See :class:`GraphAttention`."""
        width = block_tables.shape[1]
        lens, tables = staging.add(seq_lens, np.int64), staging.add(block_tables, np.int64)

        def plan() -> None:
            # NOTE: columns past ``width`` keep older block ids: valid indices, masked out.
            self.seq_lens[:size].copy_(lens.get(), non_blocking=True)
            self.block_tables[:size, :width].copy_(tables.get(), non_blocking=True)

        return plan

    def metadata(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """See :class:`GraphAttention`."""
        seq_lens, tables = self.seq_lens[:size], self.block_tables[:size]
        # NOTE: computed from the static lengths inside the graph, so each replay masks anew.
        key_mask = (self.key_positions.view(1, -1) < seq_lens.view(-1, 1)).view(size, 1, 1, -1)
        group = _DecodeGroup(self.rows[:size], tables, key_mask)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=self.rows[: size + 1],
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=1,
            max_seq_len=int(self.key_positions.numel()),
            plan=_Plan(self.block_size, [group], [], whole=True),
        )

    def close(self) -> None:
        """See :class:`GraphAttention`."""


class FlashInferGraphAttention:
    """FlashInfer's CUDA-graph decode wrappers, one per size, over shared static buffers."""

    def __init__(
        self, backend: Any, sizes: list[int], max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        import flashinfer

        from inlinelm.gpu.attention.flashinfer_backend import TENSOR_CORE_DECODE_MIN_GROUP

        max_bs = max(sizes)
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
        tensor_cores = backend.num_heads // backend.num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP
        # NOTE: the float workspace is the eager backend's: steps run one at a time, in order.
        self.wrappers: dict[int, Any] = {
            size: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend._workspace,
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
        self._planned: torch.cuda.Event | None = None

    def stage(
        self, size: int, seq_lens: IntArray, block_tables: IntArray, staging: HostStaging
    ) -> Plan:
        """See :class:`GraphAttention`."""
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

    def metadata(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """See :class:`GraphAttention`."""
        from inlinelm.gpu.attention.flashinfer_backend import _FlashInferPlan

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
        """See :class:`GraphAttention`."""
        self.wrappers.clear()


def make_graph_attention(
    backend: object,
    max_batch_size: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
) -> tuple[GraphAttention, list[int]] | None:
    """The graph attention for the runner's ``backend`` and the sizes it captures, or None
    when the backend has no static decode (then every step runs eagerly)."""
    max_blocks = -(-max_model_len // block_size)
    if isinstance(backend, TorchAttention):
        largest = max(1, min(max_batch_size, TORCH_GRAPH_MAX_KEYS // (max_blocks * block_size)))
        return TorchGraphAttention(largest, max_blocks, block_size, device), capture_sizes(largest)
    if type(backend).__name__ == "FlashInferAttention":
        sizes = capture_sizes(max_batch_size)
        return FlashInferGraphAttention(backend, sizes, max_blocks, block_size, device), sizes
    return None


@dataclass(frozen=True, slots=True)
class GraphStep:
    """A decode step staged for the static buffers: ``num_rows`` real rows of ``size``."""

    num_rows: int
    size: int
    input_ids: StagedColumn
    positions: StagedColumn
    slot_mapping: StagedColumn
    plan: Plan


class DecodeGraphs:
    """Captured decode steps (or, with ``capture=False``, the same static-buffer step run
    eagerly: the CPU test path). Build it on the thread that will replay it."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        kv_caches: list[torch.Tensor],
        attention: GraphAttention,
        sizes: list[int],
        *,
        scratch_block: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.sizes = sorted(sizes)
        self.max_batch_size = self.sizes[-1]
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.device = device
        max_bs = self.max_batch_size
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full(
            (max_bs,), scratch_block * block_size, dtype=torch.int64, device=device
        )
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        # NOTE: every size's graph copies its logits here: one output for all of them.
        self.logits = torch.zeros(max_bs, vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[int, Replay] = {}
        self._closed = False

    # -- the predicate ---------------------------------------------------------------

    def can_replay(self, inputs: StepInputs) -> bool:
        """True when ``inputs`` can run through the static buffers: a decode-only step
        (one token per row) of at most the largest size, while the graphs are open."""
        return (
            not self._closed
            and inputs.max_query_len == 1
            and len(inputs.seq_lens) <= self.max_batch_size
        )

    def padded_size(self, num_rows: int) -> int:
        """The smallest captured size holding ``num_rows`` rows."""
        return next(s for s in self.sizes if s >= num_rows)

    # -- capture ---------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, capturer: GraphCapture) -> None:
        """Capture every size, largest first (into one pool, on CUDA, on the engine thread).

        In inference mode whoever calls it: the warm-up and the captured step write the KV
        cache in place, which autograd refuses on a view of it.
        """
        for size in reversed(self.sizes):
            self._load_padding(size)
            self._graphs[size] = capturer.capture(functools.partial(self._step, size))
        capturer.finish()

    def _load_padding(self, size: int) -> None:
        """Every row a padding row: one key on the scratch block."""
        ids = np.zeros(size, dtype=np.int64)
        staging = HostStaging(self.device)
        step = self._stage_rows(
            size,
            size,
            (ids, ids, np.full(size, self.scratch_block * self.block_size)),
            ids + 1,
            np.full((size, 1), self.scratch_block),
            staging,
        )
        staging.send()
        self._load(step, None)

    # -- a step ----------------------------------------------------------------------

    def stage(self, inputs: StepInputs, staging: HostStaging) -> GraphStep:
        """Stage a step :meth:`can_replay` accepted, padded to its captured size."""
        n = len(inputs.seq_lens)
        size = self.padded_size(n)
        pad = size - n
        tables = np.full((size, max(inputs.block_tables.shape[1], 1)), self.scratch_block)
        tables[:n, : inputs.block_tables.shape[1]] = inputs.block_tables
        rows = (
            _padded(inputs.input_ids, pad, 0),
            _padded(inputs.positions, pad, 0),
            _padded(inputs.slot_mapping, pad, self.scratch_block * self.block_size),
        )
        return self._stage_rows(n, size, rows, _padded(inputs.seq_lens, pad, 1), tables, staging)

    def _stage_rows(
        self,
        n: int,
        size: int,
        rows: tuple[IntArray, IntArray, IntArray],
        seq_lens: IntArray,
        tables: IntArray,
        staging: HostStaging,
    ) -> GraphStep:
        ids, positions, slots = (staging.add(a, np.int64) for a in rows)
        plan = self.attention.stage(size, seq_lens, tables, staging)
        return GraphStep(n, size, ids, positions, slots, plan)

    def run(self, step: GraphStep, fill_pending: FillPending | None) -> torch.Tensor:
        """Run a staged step (its staging sent); return logits ``[rows, V]`` of every row.

        The returned tensor is a view of the static :attr:`logits`: read it before the next
        :meth:`run` (sampling, enqueued on the same stream, does).
        """
        self._load(step, fill_pending)
        self._graphs[step.size]()
        return self.logits[: step.num_rows]

    def _load(self, step: GraphStep, fill_pending: FillPending | None) -> None:
        """Copy a sent step into the static buffers (device to device) and plan attention."""
        size = step.size
        self.input_ids[:size].copy_(step.input_ids.get(), non_blocking=True)
        self.positions[:size].copy_(step.positions.get(), non_blocking=True)
        self.slot_mapping[:size].copy_(step.slot_mapping.get(), non_blocking=True)
        if fill_pending is not None:
            fill_pending(self.input_ids)
        step.plan()

    def _step(self, size: int) -> None:
        """The captured step: forward ``size`` rows, logits into the shared output."""
        self.logits[:size].copy_(self._forward(size))

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        meta = self.attention.metadata(size, self.slot_mapping[:size])
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            meta,
            self.logits_indices[:size],
        )

    def close(self) -> None:
        """Release the graphs, their pool and the attention's wrappers (idempotent)."""
        self._closed = True
        self._graphs.clear()
        self.attention.close()


def _padded(array: IntArray, pad: int, value: int) -> IntArray:
    if pad == 0:
        return array
    return np.concatenate([array, np.full(pad, value, dtype=np.int64)])
