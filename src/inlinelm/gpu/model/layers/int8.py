"""Int8 weights for a CPU's linear layers: one float scale per output channel, float inputs.

Weight-only, on purpose. On the default model, teacher-forced on 32 prompts' float32 greedy
answers (64 tokens each), the top-1 token of per-channel int8 weights with float
activations agrees with float32's at 97.6% of positions; quantizing the activations as
well, as torch's fbgemm and oneDNN int8 linears do (one scale per call), agrees at 67%,
and one scale per token at 94%. torch's own weight-only kernel
(``torch._weight_int8pack_mm``) takes bfloat16 activations at speed (96.9%) and float32
ones 10x slower than float32 weights. So the matmul is ours: ``csrc/int8_linear.cpp``,
compiled for this machine at first use (torch's C++ extension build; see
:func:`int8_kernel`). Where it cannot be built, :func:`int8_kernel` is None and the
layers stay float.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "int8_linear.cpp"
FEW_ROWS_MAX = 128
"""Up to this many rows the kernel's own loop runs (weights read once per block of rows);
past it, bands of dequantized weights go through torch's GEMM."""


STALE_LOCK_S = 600.0
"""A build lock older than this was left by a build that was killed (one takes ~30 s)."""


@functools.cache
def int8_kernel() -> Any:
    """The compiled kernel module (``int8_linear(x, q, scale, bias, few_rows_max)``), or
    None where it does not build (no compiler, or not an x86 or Arm CPU torch build).

    Built once per machine and torch version where torch keeps its extensions
    (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``); processes starting at
    once wait on torch's build lock, and a lock a killed build left is removed (torch would
    wait on it forever)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "torch_extensions"
    build = base / f"inlinelm-int8-linear-torch{torch.__version__}"
    lock = build / "lock"
    try:
        build.mkdir(parents=True, exist_ok=True)
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        if not any(build.glob("*.so")):
            logger.info("building the int8 kernel for this CPU, once (about 30 s)")
        return cpp_extension.load(
            name="inlinelm_int8_linear",
            sources=[str(SOURCE)],
            build_directory=str(build),
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
