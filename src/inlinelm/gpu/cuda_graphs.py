"""CUDA graphs for decode steps: one unit, in the shape of mini-sglang's ``GraphRunner``.

- :func:`build_decode_graphs` sets the unit up for a runner, once, on the engine thread.
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

Attention inside a graph reads only static buffers, and each backend owns that part: its
:meth:`~inlinelm.gpu.attention.metadata.AttentionBackend.make_graph_attention` makes the
:class:`~inlinelm.gpu.attention.metadata.GraphAttention` this unit calls (mini-sglang's
``init_capture_graph`` / ``prepare_for_capture`` / ``prepare_for_replay``), so nothing here
names a backend. On a CPU the same static-buffer step runs eagerly (``capture=False``), so
the padding and buffer plumbing are tested without a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu.attention.metadata import AttentionBackend, GraphAttention, GraphPlan, IntArray
from inlinelm.gpu.input_batch import StepInputs
from inlinelm.gpu.staging import HostStaging, StagedColumn

logger = logging.getLogger(__name__)

FillPending = Callable[[torch.Tensor], None]
"""Writes the tokens sampled by steps in flight into a step's ``input_ids`` (on the device)."""


def graphs_capturable(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a CUDA graph can capture ``model``'s decode step (a sparse MLP off its
    grouped GEMM reads expert counts on the host)."""
    from inlinelm.gpu.model.layers.moe import SparseMoE

    for name, module in model.named_modules():
        if isinstance(module, SparseMoE) and not module.runs_grouped(device, dtype):
            logger.warning("CUDA graphs off: %s's experts run one at a time here", name)
            return False
    return True


def build_decode_graphs(
    model: Callable[..., torch.Tensor],
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend,
    config: EngineConfig,
    *,
    max_model_len: int,
    scratch_block: int,
    vocab_size: int,
    device: torch.device,
    capture: bool,
) -> DecodeGraphs | None:
    """A runner's decode graphs over its ``kv_caches``, whose block ``scratch_block`` the
    pool never hands out (padding rows write there), for up to ``max_cuda_graph_batch_size`` rows (else ``max_num_seqs``,
    and never more); with ``capture``, captured as CUDA graphs, else run eagerly through
    the same static buffers (the CPU tests' switch). None when ``backend`` has no static
    decode (then every step runs eagerly).
    """
    limit = min(config.max_cuda_graph_batch_size or config.max_num_seqs, config.max_num_seqs)
    attention = backend.make_graph_attention(limit, max_model_len, config.block_size, device)
    if attention is None:
        return None
    sizes = capture_sizes(attention.max_batch_size)
    graphs = DecodeGraphs(
        model,
        kv_caches,
        attention,
        sizes,
        scratch_block=scratch_block,
        block_size=config.block_size,
        vocab_size=vocab_size,
        device=device,
    )
    if not capture:
        graphs.capture(EagerCapture())
        return graphs
    start = time.perf_counter()
    graphs.capture(CudaGraphCapture(device))
    logger.info(
        "captured %d decode graphs (batch 1..%d) in %.2f s",
        len(sizes),
        sizes[-1],
        time.perf_counter() - start,
    )
    return graphs


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


@dataclass(frozen=True, slots=True)
class GraphStep:
    """A decode step staged for the static buffers: ``num_rows`` real rows of ``size``."""

    num_rows: int
    size: int
    input_ids: StagedColumn
    positions: StagedColumn
    slot_mapping: StagedColumn
    plan: GraphPlan


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
        self.attention.init_capture_graph(self.sizes)

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
        plan = self.attention.prepare_for_replay(size, seq_lens, tables, staging)
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
        meta = self.attention.prepare_for_capture(size, self.slot_mapping[:size])
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
