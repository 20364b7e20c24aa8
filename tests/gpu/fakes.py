"""A stand-in ``flashinfer`` for the CPU tests, written from FlashInfer's documented
semantics: the model's kernels (norms, RoPE, the gated activation) and the attention
wrappers (which check what the backend hands them, then attend in torch). The
``fake_flashinfer`` fixture (tests/gpu/conftest.py) installs it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from inlinelm.gpu.attention.page_table import PageTable, PageTableArrays
from tests.gpu.attention.page_table_oracle import paged_attention


def fake_flashinfer_module() -> types.ModuleType:
    """A ``flashinfer`` module with the kernels the model uses and the two wrappers."""
    module = types.ModuleType("flashinfer")
    vars(module).update(
        norm=types.SimpleNamespace(
            rmsnorm=_rmsnorm,
            fused_add_rmsnorm=_fused_add_rmsnorm,
            gemma_rmsnorm=_gemma_rmsnorm,
            gemma_fused_add_rmsnorm=_gemma_fused_add_rmsnorm,
        ),
        rope=types.SimpleNamespace(
            apply_rope_with_cos_sin_cache_inplace=_apply_rope_with_cos_sin_cache_inplace
        ),
        activation=types.SimpleNamespace(
            silu_and_mul=_silu_and_mul, gelu_tanh_and_mul=_gelu_tanh_and_mul
        ),
        BatchPrefillWithPagedKVCacheWrapper=FakePrefill,
        BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
    )
    return module


# -- the model's kernels ------------------------------------------------------------------


def _rmsnorm(
    input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None
) -> torch.Tensor:
    h = input.float()
    result = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(
        input.dtype
    )
    return result if out is None else out.copy_(result)


def _fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    residual.add_(input)
    input.copy_(_rmsnorm(residual, weight, eps))


def _gemma_rmsnorm(
    input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None
) -> torch.Tensor:
    assert input.dim() == 2, "FlashInfer's norms take [N, D]"
    return _rmsnorm(input, weight.float() + 1.0, eps, out)


def _gemma_fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> None:
    residual.add_(input)
    input.copy_(_gemma_rmsnorm(residual, weight, eps))


def _apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    assert is_neox and cos_sin_cache.dtype == torch.float32
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    rotated = cos_sin_cache.shape[-1]  # FlashInfer's rotary_dim: the table's width
    for heads in (query, key):
        x = heads.view(heads.shape[0], -1, head_size)[..., :rotated]
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype))


def _silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    half = input.shape[-1] // 2
    result = F.silu(input[..., :half]) * input[..., half:]
    return result if out is None else out.copy_(result)


def _gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    half = input.shape[-1] // 2
    result = F.gelu(input[..., :half], approximate="tanh") * input[..., half:]
    return result if out is None else out.copy_(result)


# -- the attention wrappers ---------------------------------------------------------------


class FakeWrapper:
    """Checks what FlashInferAttention hands FlashInfer's wrappers, then attends in torch.

    The positional parameters keep FlashInfer's order and names; options must come by
    keyword (the backend's rule, valid on 0.6.x and 0.7.x). ``sm_scale``, ``window_left``
    and ``logits_soft_cap`` are applied in FlashInfer's terms
    (:func:`~tests.gpu.attention.page_table_oracle.paged_attention`). With
    ``use_cuda_graph`` a plan copies the table into the wrapper's fixed buffers and
    ``run`` reads them there, as FlashInfer's graph wrappers do.
    """

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **options: Any) -> None:
        assert kv_layout == "NHD" and options.get("backend") == "fa2"
        self.workspace = workspace
        self.int_workspace = torch.empty(0, dtype=torch.uint8)  # FlashInfer's own, 8 MiB
        self.options = options
        self.plans = 0
        self.table: PageTable | None = None
        self.attention: dict[str, Any] = {}

    def reset_workspace_buffer(
        self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor
    ) -> None:
        self.workspace = float_workspace_buffer
        self.int_workspace = int_workspace_buffer

    def _plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        options: dict[str, Any],
    ) -> None:
        for host in (qo_indptr, kv_indptr, kv_last_page_len):
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert kv_indices.dtype == torch.int32
        assert options["q_data_type"] == options["kv_data_type"] == torch.float32
        assert options["pos_encoding_mode"] == "NONE"
        self.attention = _attention_options(options)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        if self.options.get("use_cuda_graph"):
            kv_indptr, kv_indices, kv_last_page_len = self._copy_to_buffers(
                kv_indptr, kv_indices, kv_last_page_len
            )
        arrays = PageTableArrays(qo_indptr, kv_indptr, kv_last_page_len, kv_indices)
        self.table = PageTable(page_size, len(kv_last_page_len), False, arrays, arrays)
        self.plans += 1

    def _copy_to_buffers(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's graph-mode plan: the batch size is the buffers', the table is
        copied into them, and the kernels read the buffers."""
        fixed = self.options["paged_kv_indptr_buffer"], self.options["paged_kv_indices_buffer"]
        last = self.options["paged_kv_last_page_len_buffer"]
        assert len(last_page_len) == len(last) and len(indices) <= len(fixed[1])
        fixed[0].copy_(indptr)
        last.copy_(last_page_len)
        fixed[1][: len(indices)].copy_(indices)
        return fixed[0], fixed[1], last

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> Any:
        # NOTE: FlashInfer's decode kernel takes q's row and head strides (only the last
        # dimension must be dense); prefill is given a dense q.
        assert self.table is not None and q.stride(-1) == 1
        assert isinstance(self, FakeDecode) or q.is_contiguous()
        k_pages, v_pages = paged_kv_cache
        assert k_pages.shape[1:] == (self.table.page_size, *self.heads[1:])
        assert q.shape[1:] == (self.heads[0], self.heads[2])
        return paged_attention(q, k_pages, v_pages, self.table, **self.attention)


def _attention_options(options: dict[str, Any]) -> dict[str, Any]:
    """The window, soft cap and scale of a plan, checked as FlashInfer takes them: the
    scale given (FlashInfer's default is ``head_dim ** -0.5``), ``window_left`` an int of
    at least -1 (-1: none), ``logits_soft_cap`` a float of at least 0 (0: none)."""
    scale, window_left, cap = (
        options["sm_scale"],
        options["window_left"],
        options["logits_soft_cap"],
    )
    assert isinstance(scale, float) and scale > 0
    assert isinstance(window_left, int) and window_left >= -1
    assert isinstance(cap, float) and cap >= 0.0
    return {"sm_scale": scale, "window_left": window_left, "logits_soft_cap": cap}


class FakePrefill(FakeWrapper):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        **options: Any,
    ) -> None:
        assert options["causal"] is True
        self._plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            options,
        )


class FakeDecode(FakeWrapper):
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(
            qo_indptr,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            options,
        )
