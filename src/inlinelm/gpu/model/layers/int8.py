"""Int8 weights for a CPU's linear layers: one float scale per output channel, float inputs.

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

import torch

from inlinelm.gpu.model.cpu_extension import cpu_extension

FEW_ROWS_MAX = 128
"""Up to this many rows the kernel's own loop runs (weights read once per block of rows);
past it, bands of dequantized weights go through torch's GEMM."""


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 and one float32 scale per row (symmetric: the row's
    largest magnitude maps to 127; an all-zero row gets scale 1)."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` for ``x`` [..., in] of any float dtype."""
    kernel = cpu_extension()
    assert kernel is not None, "quantize only where the kernel built"
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():  # a decoder's rows
        out: torch.Tensor = kernel.int8_linear(x, q, scale, bias, FEW_ROWS_MAX)
        return out
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    y: torch.Tensor = kernel.int8_linear(flat, q, scale, bias, FEW_ROWS_MAX)
    y = y.reshape(*x.shape[:-1], q.shape[0])
    return y if x.dtype == torch.float32 else y.to(x.dtype)
