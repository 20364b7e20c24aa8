"""Int8 weights for a CPU's linear layers: one float scale per output channel (or per group
of 32 weights of a row: a Q8_0 file's own blocks, kept as they are), float inputs.

Weight-only, on purpose. On the default model, teacher-forced on 32 prompts' float32 greedy
answers (64 tokens each), the top-1 token of per-channel int8 weights with float
activations agrees with float32's at 97.6% of positions; quantizing the activations as
well, as torch's fbgemm and oneDNN int8 linears do (one scale per call), agrees at 67%,
and one scale per token at 94%. torch's own weight-only kernel
(``torch._weight_int8pack_mm``) takes bfloat16 activations at speed (96.9%) and float32
ones 10x slower than float32 weights. So the matmul is ours: ``csrc/int8_linear.cpp``,
compiled for this machine at first use with the project's other CPU kernels
(:mod:`inlinelm.gpu.model.cpu_extension`). Where they cannot be built, the layers stay
float.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from inlinelm.gpu.model.cpu_extension import cpu_extension

FEW_ROWS_MAX = 512
"""Up to this many rows the kernel's own loop runs (weights read once per block of rows);
past it, bands of dequantized weights go through oneDNN's float GEMM (torch's where this
torch has no oneDNN). Measured on the default model's shapes, 2 threads: the loop takes
212 ms for a step's matmuls at 256 rows where dequantizing and oneDNN take 278, and they
are even at 512; at 1024 rows 1113 against 904."""

BAND_FLOATS = 1 << 22
"""Dequantized weights (floats) per oneDNN call: one call for every layer of a small model
but its LM head, whose whole float copy would be a large temporary."""


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 and one float32 scale per row (symmetric: the row's
    largest magnitude maps to 127; an all-zero row gets scale 1). Computed in bands of
    rows (:data:`BAND_FLOATS` values), so a large matrix (an LM head) needs a band's
    temporaries, not several copies of itself."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    band = max(1, BAND_FLOATS // max(cols, 1))
    for r0 in range(0, rows, band):
        part = weight[r0 : r0 + band].float()
        s = part.abs().amax(dim=1) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[r0 : r0 + band] = torch.round(part / s[:, None]).clamp(-127, 127).to(torch.int8)
        scale[r0 : r0 + band] = s
    return q, scale


def quantize_groups(weight: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 with a float32 scale per group of ``in / groups``
    consecutive weights of a row ([out, groups]; ``groups`` 1: :func:`quantize_rows`). Of
    a Q8_0 file's dequantized weights, with groups of its 32-weight blocks, these are the
    file's own values and scales."""
    if groups == 1:
        return quantize_rows(weight)
    rows, cols = weight.shape
    q, scale = quantize_rows(weight.reshape(rows * groups, cols // groups))
    return q.reshape(rows, cols), scale.reshape(rows, groups)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` [out, in] times its scales ([out], or [out, groups]), in float32."""
    groups = scale.reshape(q.shape[0], -1)
    weight = q.float().reshape(q.shape[0], groups.shape[1], -1) * groups[:, :, None]
    return weight.reshape(q.shape)


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequantize(q, scale).T + bias`` for ``x`` [..., in] of any float dtype."""
    kernel = cpu_extension()
    assert kernel is not None, "quantize only where the kernel built"
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():  # a decoder's rows
        return _matmul(kernel, x, q, scale, bias)
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = _matmul(kernel, flat, q, scale, bias).reshape(*x.shape[:-1], q.shape[0])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _matmul(
    kernel: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """:func:`int8_matmul` of a contiguous float32 ``x`` [M, K]."""
    if x.shape[0] <= FEW_ROWS_MAX or not _onednn_linear():
        out: torch.Tensor = kernel.int8_linear(x, q, scale, bias, FEW_ROWS_MAX)
        return out
    n = q.shape[0]
    band = max(1, BAND_FLOATS // q.shape[1])
    linear = torch.ops.mkldnn._linear_pointwise
    if n <= band:
        whole: torch.Tensor = linear(
            x, kernel.dequantize_rows(q, scale, 0, n), bias, "none", [], ""
        )
        return whole
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for n0 in range(0, n, band):
        n1 = min(n, n0 + band)
        part = None if bias is None else bias[n0:n1]
        y[:, n0:n1] = linear(x, kernel.dequantize_rows(q, scale, n0, n1), part, "none", [], "")
    return y


@functools.cache
def _onednn_linear() -> bool:
    """Whether torch's oneDNN linear (plain float32 weights) is here."""
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
