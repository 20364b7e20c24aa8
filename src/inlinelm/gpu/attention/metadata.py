"""Paged attention's interface: one step's metadata and what every backend implements.

One forward carries the flattened tokens of many sequences (prefill chunks and decode
tokens mixed). Each layer writes its new K/V into the paged cache at ``slot_mapping`` and
attends over the sequence's whole context through its block table.

Each backend also owns its part of a CUDA-graphed decode step (mini-sglang's backend
hooks): :meth:`AttentionBackend.make_graph_attention` builds a :class:`GraphAttention`,
whose ``init_capture_graph``, ``prepare_for_capture`` and ``prepare_for_replay``
:mod:`inlinelm.gpu.cuda_graphs` calls without knowing which backend it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from inlinelm.gpu.staging import HostStaging

IntArray = npt.NDArray[np.int64]
"""A host array of int64 (positions, lengths, ids): the one spelling of the type."""

GraphPlan = Callable[[], None]
"""Loads a staged decode step into a graph attention's static buffers, once the staging
is sent (it runs before each replay, never inside a capture)."""


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention computes, beside the step's shared page table.

    ``scale`` multiplies the query-key products; ``sliding_window`` (None: the whole
    context) is how many keys a query sees, itself included: key ``j`` is visible to the
    query at ``i`` when ``i - window < j <= i`` (transformers' sliding mask);
    ``softcap`` (None: none) caps the scaled products at ``softcap * tanh(s / softcap)``
    before the softmax (Gemma 2). Layers of one kind share one plan per step.
    """

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and passed to every layer.

    ``query_start_loc[i]:query_start_loc[i+1]`` are sequence ``i``'s tokens in the flat batch;
    ``seq_lens[i]`` is its context length once this step's tokens are written. The ``host_*``
    fields, when the runner sets them, are the numpy arrays those tensors were copied from:
    backends that plan on the host (FlashInfer) read them instead of copying back.
    """

    slot_mapping: torch.Tensor  # [T] int64, flat cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    max_query_len: int
    max_seq_len: int
    # Derived once per step by the backend's prepare(), for its own use.
    plan: Any = None
    host_query_start_loc: IntArray | None = None
    host_seq_lens: IntArray | None = None
    host_block_tables: IntArray | None = None


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
        layer: LayerAttention,
    ) -> torch.Tensor:
        """Write ``k``/``v`` [T, KVH, D] into ``kv_cache`` [2, slots, KVH, D]; return [T, H, D],
        attended as ``layer`` says."""
        ...

    def make_graph_attention(
        self, max_batch_size: int, max_model_len: int, block_size: int, device: torch.device
    ) -> GraphAttention | None:
        """The attention of graphed decode steps of up to ``max_batch_size`` rows whose
        contexts reach ``max_model_len`` tokens, on ``device``; None when this backend has
        no static decode (every step then runs eagerly).

        Called once, on the engine thread, before any capture. The result may hold fewer
        rows than asked (its ``max_batch_size``): the sizes captured stop there.
        """
        ...


class GraphAttention(Protocol):
    """A backend's attention inside a graphed decode step: metadata over static buffers,
    planned outside the graph. Every step it serves is ``size`` rows of one query token.

    Its life, as :class:`~inlinelm.gpu.cuda_graphs.DecodeGraphs` drives it:
    :meth:`init_capture_graph` once with every size; for each size, a
    :meth:`prepare_for_replay` of padding rows, its plan run, then the capture of a step
    whose layers read :meth:`prepare_for_capture`'s metadata; before every replay, a
    :meth:`prepare_for_replay` of the real rows and its plan; :meth:`close` at the end.
    """

    @property
    def max_batch_size(self) -> int:
        """The most rows one graphed step holds (at most what the backend was asked)."""
        ...

    def init_capture_graph(self, sizes: list[int]) -> None:
        """Make what each size needs of its own (FlashInfer: one wrapper per size) before
        the first capture; ``sizes`` are ascending and end at :attr:`max_batch_size`."""
        ...

    def prepare_for_capture(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """The metadata a step of ``size`` rows passes its layers, built from static
        buffers only (it runs inside the capture, so each replay reads them anew);
        ``slot_mapping`` is the step's static slot buffer."""
        ...

    def prepare_for_replay(
        self, size: int, seq_lens: IntArray, block_tables: IntArray, staging: HostStaging
    ) -> GraphPlan:
        """Stage a padded step of ``size`` rows (``seq_lens`` and ``block_tables`` of every
        row, padding included); the plan it returns loads the static buffers once the
        staging is sent."""
        ...

    def close(self) -> None:
        """Drop wrappers and buffers (idempotent)."""
        ...
