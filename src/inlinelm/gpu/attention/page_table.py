"""The step's page table in FlashInfer's CSR form, and the paged view of the KV cache.

For request ``i`` with ``kv_len_i`` context tokens (this step's tokens included) on the
pages of its block table:

- ``qo_indptr[i]:qo_indptr[i+1]`` are its query tokens in the flat batch;
- ``kv_indptr[i]:kv_indptr[i+1]`` are its pages in ``kv_indices``, ``ceil(kv_len_i / page)``
  of them, in block-table order;
- ``kv_last_page_len[i]`` is the number of tokens on its last page, in ``1..page_size``.

The four arrays are built on the host with numpy into one packed int32 buffer and sent to
the device in one copy; the tensors backends read are views into that buffer. The same
builder feeds the FlashInfer backend and the pure-torch :class:`PageTableAttention`, so
the CPU tests that hold the second against the torch backend prove the first's table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata, IntArray
from inlinelm.gpu.staging import copy_to_device


@dataclass(frozen=True, slots=True)
class PageTableArrays:
    """The four page-table arrays (int32), views into one packed buffer."""

    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_last_page_len: torch.Tensor  # [B]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]

    @classmethod
    def unpack(cls, buffer: torch.Tensor, batch_size: int) -> PageTableArrays:
        """Views of ``buffer`` laid out as ``[qo_indptr | kv_indptr | kv_last_page_len | kv_indices]``."""
        b = batch_size
        return cls(
            qo_indptr=buffer[: b + 1],
            kv_indptr=buffer[b + 1 : 2 * b + 2],
            kv_last_page_len=buffer[2 * b + 2 : 3 * b + 2],
            kv_indices=buffer[3 * b + 2 :],
        )


@dataclass(frozen=True, slots=True)
class PageTable:
    """One step's page table, on the host (for planning) and on the device (for kernels)."""

    page_size: int
    batch_size: int
    is_decode: bool  # every request has exactly one query token
    host: PageTableArrays
    device: PageTableArrays


def pack_page_table(
    query_start_loc: IntArray, seq_lens: IntArray, block_tables: IntArray, page_size: int
) -> npt.NDArray[np.int32]:
    """The packed int32 buffer ``[qo_indptr | kv_indptr | kv_last_page_len | kv_indices]``.

    ``block_tables[i]`` holds request ``i``'s block ids (columns past its pages are ignored,
    whatever they hold); ``seq_lens[i] >= 1`` counts this step's tokens.
    """
    b = len(seq_lens)
    num_pages = (seq_lens + page_size - 1) // page_size
    assert b == 0 or (seq_lens.min() >= 1 and block_tables.shape[1] >= num_pages.max())
    buffer = np.empty(3 * b + 2 + int(num_pages.sum()), dtype=np.int32)
    buffer[: b + 1] = query_start_loc
    buffer[b + 1] = 0
    buffer[b + 2 : 2 * b + 2] = np.cumsum(num_pages)
    buffer[2 * b + 2 : 3 * b + 2] = seq_lens - (num_pages - 1) * page_size
    # NOTE: boolean indexing walks the table row-major, so each request's pages land in
    # order and the requests one after another, as kv_indptr says.
    in_use = np.arange(block_tables.shape[1]) < num_pages[:, None]
    buffer[3 * b + 2 :] = block_tables[in_use]
    return buffer


def build_page_table(
    query_start_loc: IntArray,
    seq_lens: IntArray,
    block_tables: IntArray,
    page_size: int,
    device: torch.device,
) -> PageTable:
    """Build the step's page table on the host and send it to ``device`` in one copy."""
    packed = torch.from_numpy(pack_page_table(query_start_loc, seq_lens, block_tables, page_size))
    # NOTE: from pageable memory a non-blocking copy returns once the bytes are staged, so
    # the numpy buffer may go away as soon as this returns. On the CPU it is no copy at all.
    on_device = copy_to_device(packed, device)
    batch_size = len(seq_lens)
    return PageTable(
        page_size=page_size,
        batch_size=batch_size,
        is_decode=bool(np.all(np.diff(query_start_loc) == 1)),
        host=PageTableArrays.unpack(packed, batch_size),
        device=PageTableArrays.unpack(on_device, batch_size),
    )


def step_page_table(meta: AttentionMetadata, page_size: int, device: torch.device) -> PageTable:
    """The page table of the step ``meta`` describes, from its host arrays when it has them.

    Without them the arrays are copied back from the device (a sync; the runner's warm-up).
    """
    return build_page_table(
        _host(meta.host_query_start_loc, meta.query_start_loc),
        _host(meta.host_seq_lens, meta.seq_lens),
        _host(meta.host_block_tables, meta.block_tables),
        page_size,
        device,
    )


def _host(array: IntArray | None, tensor: torch.Tensor) -> IntArray:
    if array is not None:
        return array
    result: IntArray = tensor.cpu().numpy().astype(np.int64, copy=False)
    return result


def paged_kv_view(kv_cache: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache [2, slots, KVH, D] as FlashInfer's NHD pages: a view, no copy.

    Returns ``(k_pages, v_pages)``, each [num_pages, page_size, KVH, D]; slot ``s`` is
    token ``s % page_size`` of page ``s // page_size``, as the slot mapping has it.
    """
    _, slots, num_kv_heads, head_dim = kv_cache.shape
    pages = kv_cache.view(2, slots // page_size, page_size, num_kv_heads, head_dim)
    return pages[0], pages[1]
