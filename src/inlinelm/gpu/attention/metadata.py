"""Paged attention's interface: one step's metadata and what every backend implements.

One forward carries the flattened tokens of many sequences (prefill chunks and decode
tokens mixed). Each layer writes its new K/V into the paged cache at ``slot_mapping`` and
attends over the sequence's whole context through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

IntArray = npt.NDArray[np.int64]
"""A host array of int64 (positions, lengths, ids): the one spelling of the type."""


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
    ) -> torch.Tensor:
        """Write ``k``/``v`` [T, KVH, D] into ``kv_cache`` [2, slots, KVH, D]; return [T, H, D]."""
        ...
