"""The page table in FlashInfer's form, proved on the CPU: attention that reads only the
table, masked and capped in FlashInfer's terms, equals the torch backend on random mixed
steps and layer kinds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inlinelm.gpu.attention.metadata import LayerAttention
from inlinelm.gpu.attention.page_table import (
    build_page_table,
    pack_page_table,
    paged_kv_view,
    step_page_table,
)
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.kv_cache import write_kv
from tests.gpu.attention.page_table_oracle import PageTableAttention
from tests.gpu.paged_steps import Shape, make_step, run_backend

CPU = torch.device("cpu")


def test_pack_page_table_lays_out_the_four_arrays() -> None:
    # three requests, page 4: a chunk after a 3-token prefix, a decode filling its page
    # exactly, a fresh 9-token prompt; stale ids pad the table past each one's pages
    buffer = pack_page_table(
        query_start_loc=np.array([0, 3, 4, 6]),
        seq_lens=np.array([6, 4, 9]),
        block_tables=np.array([[7, 2, 9], [5, 9, 9], [1, 3, 0]]),
        page_size=4,
    )
    assert buffer.dtype == np.int32
    qo_indptr, kv_indptr, kv_last_page_len = [0, 3, 4, 6], [0, 2, 3, 6], [2, 4, 1]
    kv_indices = [7, 2, 5, 1, 3, 0]
    assert buffer.tolist() == [*qo_indptr, *kv_indptr, *kv_last_page_len, *kv_indices]


def test_build_page_table_views_one_buffer() -> None:
    table = build_page_table(
        np.array([0, 1, 2]), np.array([1, 17]), np.array([[4, 0], [6, 2]]), 16, CPU
    )
    arrays = table.device
    base = arrays.qo_indptr.untyped_storage().data_ptr()
    for view in (arrays.kv_indptr, arrays.kv_last_page_len, arrays.kv_indices):
        assert view.untyped_storage().data_ptr() == base
    # on the CPU the "transfer" is no copy at all
    assert table.host.kv_indices.untyped_storage().data_ptr() == base
    assert table.is_decode
    assert arrays.kv_indices.tolist() == [4, 6, 2]
    assert arrays.kv_last_page_len.tolist() == [1, 1]


def test_paged_kv_view_sees_slot_writes_without_a_copy() -> None:
    kv_cache = torch.zeros(2, 3 * 4, 2, 8)
    k_pages, v_pages = paged_kv_view(kv_cache, 4)
    assert k_pages.shape == (3, 4, 2, 8)
    assert k_pages.data_ptr() == kv_cache.data_ptr()
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    write_kv(kv_cache, k, v, torch.tensor([9, 2]))  # page 2 token 1, page 0 token 2
    assert torch.equal(k_pages[2, 1], k[0]) and torch.equal(v_pages[0, 2], v[1])


def test_step_page_table_copies_back_without_host_arrays() -> None:
    step = make_step(Shape(4, 2, 1, 8), [(5, 3), (0, 1), (7, 1)], seed=0)
    with_host = step_page_table(step.metadata(CPU), 4, CPU)
    without = step_page_table(step.metadata(CPU, host=False), 4, CPU)
    assert with_host.host.qo_indptr.tolist() == without.host.qo_indptr.tolist()
    assert with_host.host.kv_indices.tolist() == without.host.kv_indices.tolist()
    assert not with_host.is_decode


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    return Shape(
        block_size=draw(st.sampled_from([1, 16])),
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=8,
    )


# (cached prefix, new tokens): half decode rows, the rest ragged chunks, some past a prefix
requests = st.lists(
    st.tuples(st.integers(0, 40), st.one_of(st.just(1), st.integers(1, 24))),
    min_size=1,
    max_size=5,
)


# a layer's kind: its scale, a window from one key to past every context, a soft cap
kinds = st.builds(
    LayerAttention,
    scale=st.sampled_from([8**-0.5, 0.6]),
    sliding_window=st.one_of(st.none(), st.integers(1, 70)),
    softcap=st.one_of(st.none(), st.sampled_from([0.5, 3.0])),
)


@settings(max_examples=50, deadline=None)
@given(shape=shapes(), batch=requests, seed=st.integers(0, 2**16), layer=kinds)
def test_page_table_attention_equals_torch_backend(
    shape: Shape, batch: list[tuple[int, int]], seed: int, layer: LayerAttention
) -> None:
    """The window as FlashInfer's ``window_left`` (and its mask), the soft cap as its
    ``logits_soft_cap``, against transformers' window and cap in the torch backend."""
    step = make_step(shape, batch, seed)
    heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    expected, expected_cache = run_backend(
        TorchAttention(*heads), step, shape.block_size, layer=layer
    )
    out, cache = run_backend(PageTableAttention(*heads), step, shape.block_size, layer=layer)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("block_size", [1, 16])
def test_page_table_attention_on_a_wide_decode_step(block_size: int) -> None:
    # more rows than one torch decode group, lengths on and off page boundaries
    lengths = [15, 16, 17, 0, 31, 32, 1, 47, 5, 63, 64]
    step = make_step(Shape(block_size, 6, 2, 8), [(n, 1) for n in lengths], seed=3)
    expected, _ = run_backend(TorchAttention(6, 2, 8), step, block_size)
    out, _ = run_backend(PageTableAttention(6, 2, 8), step, block_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
