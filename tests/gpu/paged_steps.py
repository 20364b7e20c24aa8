"""Random paged attention steps for the backend tests: ragged chunks, cached prefixes,
partly filled last pages, scattered block ids and stale padding in the block table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inlinelm.gpu.attention.metadata import AttentionBackend, AttentionMetadata, LayerAttention

CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Shape:
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class Step:
    """One step's inputs: attention metadata arrays (numpy), the fresh q/k/v, a filled cache."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, slots, KVH, D], prefixes already written

    def metadata(self, device: torch.device, *, host: bool = True) -> AttentionMetadata:
        """The step's metadata on ``device``, with the host arrays when ``host``."""

        def to(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return AttentionMetadata(
            slot_mapping=to(self.slot_mapping),
            query_start_loc=to(self.query_start_loc),
            seq_lens=to(self.seq_lens),
            block_tables=to(self.block_tables),
            max_query_len=int(np.diff(self.query_start_loc).max()),
            max_seq_len=int(self.seq_lens.max()),
            host_query_start_loc=self.query_start_loc if host else None,
            host_seq_lens=self.seq_lens if host else None,
            host_block_tables=self.block_tables if host else None,
        )


def make_step(
    shape: Shape,
    requests: list[tuple[int, int]],
    seed: int,
    *,
    data_seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> Step:
    """A step where request ``i`` has ``requests[i] = (num_cached, num_new)`` tokens.

    Block ids are a random permutation of the pool (so pages are scattered), and the
    table's padding past a request's pages holds random valid ids, like stale rows of the
    persistent batch. ``data_seed`` (default ``seed``) draws q/k/v and the cache alone, so
    two layers of one step share the table and differ in their data.
    """
    rng = np.random.default_rng(seed)
    bs = shape.block_size
    cached = np.array([c for c, _ in requests], dtype=np.int64)
    new = np.array([n for _, n in requests], dtype=np.int64)
    seq_lens = cached + new
    num_pages = -(-seq_lens // bs)
    max_pages = int(num_pages.max())
    num_blocks = int(num_pages.sum()) + 2
    ids = rng.permutation(num_blocks)
    block_tables = rng.integers(0, num_blocks, size=(len(requests), max_pages))
    starts = np.concatenate([[0], np.cumsum(num_pages)])
    for i in range(len(requests)):
        block_tables[i, : num_pages[i]] = ids[starts[i] : starts[i + 1]]
    query_start_loc = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    row = np.repeat(np.arange(len(requests)), new)
    positions = (
        np.repeat(cached, new) + np.arange(int(new.sum())) - np.repeat(query_start_loc[:-1], new)
    )
    slot_mapping = block_tables[row, positions // bs] * bs + positions % bs
    gen = torch.Generator().manual_seed(seed if data_seed is None else data_seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    t, h, kvh, d = int(new.sum()), shape.num_heads, shape.num_kv_heads, shape.head_dim
    # q is a head slice of a fused tensor, as the model hands it over (not contiguous).
    q, k = randn(t, h + kvh, d).split([h, kvh], dim=1)
    return Step(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables.astype(np.int64),
        slot_mapping=slot_mapping.astype(np.int64),
        q=q,
        k=k,
        v=randn(t, kvh, d),
        kv_cache=randn(2, num_blocks * bs, kvh, d),
    )


def run_backend(
    backend: AttentionBackend,
    step: Step,
    block_size: int,
    *,
    host: bool = True,
    layer: LayerAttention | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare and run one layer of ``step`` on a copy of its cache: (output, cache after);
    ``layer`` defaults to plain attention at the usual ``head_dim ** -0.5`` scale."""
    device = step.q.device
    meta = step.metadata(device, host=host)
    backend.prepare(meta, block_size)
    cache = step.kv_cache.clone()
    out = backend.forward(step.q, step.k, step.v, cache, meta, layer or plain_layer(step.q))
    return out, cache


def plain_layer(q: torch.Tensor) -> LayerAttention:
    """Plain attention for queries ``q`` [..., D]: scale ``D ** -0.5``, no window, no cap."""
    return LayerAttention(scale=q.shape[-1] ** -0.5)
