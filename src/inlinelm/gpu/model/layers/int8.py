"""Int8 weights for a CPU's linear layers: one float scale per output channel, float inputs.

Weight-only, on purpose. On the default model, teacher-forced on 32 prompts' float32 greedy
answers (64 tokens each), the top-1 token of per-channel int8 weights with float
activations agrees with float32's at 97.6% of positions; quantizing the activations as
well, as torch's fbgemm and oneDNN int8 linears do (one scale per call), agrees at 67%,
and one scale per token at 94%. torch's own weight-only kernel
(``torch._weight_int8pack_mm``) takes bfloat16 activations at speed (96.9%) and float32
ones 10x slower than float32 weights. So the matmul is ours: ``csrc/int8_linear.cpp``,
compiled for this machine at first use (torch's C++ extension build, cached under
``$TORCH_EXTENSIONS_DIR``). Where it cannot be built, :func:`int8_kernel` is None and the
layers stay float.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "int8_linear.cpp"
FEW_ROWS_MAX = 128
"""Up to this many rows the kernel's own loop runs (weights read once per block of rows);
past it, bands of dequantized weights go through torch's GEMM."""


@functools.cache
def int8_kernel() -> Any:
    """The compiled kernel module (``int8_linear(x, q, scale, bias, few_rows_max)``), or
    None where it does not build (no compiler, or not an x86 or Arm CPU torch build)."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="inlinelm_int8_linear",
            sources=[str(SOURCE)],
            # NOTE: -fopenmp, or at::parallel_for (inline OpenMP) runs on one thread; the
            # libgomp.so.1 it links is the one torch already loaded (same soname).
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:  # NOTE: the compiler's boundary
        logger.warning("the int8 kernel did not build (%s): linear layers stay float", e)
        return None


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
    kernel = int8_kernel()
    assert kernel is not None, "quantize only where the kernel built"
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    y: torch.Tensor = kernel.int8_linear(flat, q, scale, bias, FEW_ROWS_MAX)
    y = y.reshape(*x.shape[:-1], q.shape[0])
    return y if x.dtype == torch.float32 else y.to(x.dtype)
