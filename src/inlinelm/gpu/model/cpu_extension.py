"""inlinelm's CPU extension: the C++ operators in ``csrc/`` (the block-quantized linear
layer, and the fused float32 RMSNorm, RoPE, gated activations, KV write and paged decode
attention), compiled for this machine's instructions at first use with torch's C++
extension build.

Built once per machine, torch version and source: where torch keeps its extensions
(``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``). Processes starting at once
wait on torch's build lock, and a lock a killed build left is removed (torch would wait on
it forever). Where it cannot be built (no compiler, an unusual CPU), :func:`cpu_extension`
is None and the model runs torch's own ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "block_tiles.cpp",
    "block_linear.cpp",
    "block_linear_avx2.cpp",
    "block_linear_amx.cpp",
    "block_linear_amx_int8.cpp",
    "cpu_ops.cpp",
    "paged_attention.cpp",
    "decoder_stack.cpp",
    "bindings.cpp",
)
HEADERS = ("ops.h", "vec.h", "block_tiles.h", "cpu_checks.h")

STALE_LOCK_S = 600.0
"""A build lock older than this was left by a build that was killed (one takes ~40 s)."""


@functools.cache
def cpu_extension() -> Any:
    """The compiled module (the operators ``csrc/ops.h`` declares), or None where it does
    not build."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "torch_extensions"
    build = base / f"inlinelm-cpu-ops-torch{torch.__version__}"
    lock = build / "lock"
    try:
        build.mkdir(parents=True, exist_ok=True)
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        if not any(build.glob("*.so")):
            logger.info("building inlinelm's CPU kernels for this CPU, once (about 40 s)")
        return cpp_extension.load(
            name="inlinelm_cpu_ops",
            sources=[str(CSRC / name) for name in SOURCES],
            build_directory=str(build),
            # NOTE: -fopenmp, or at::parallel_for (inline OpenMP) runs on one thread; the
            # libgomp.so.1 it links is the one torch already loaded (same soname). torch
            # rebuilds when a source's contents change, not a header's: their hash is a flag.
            # -ffp-contract=off: a multiply and an add stay two roundings unless the code
            # says std::fma, so the plain loops compute what the vector ones do, to the bit.
            extra_cflags=[
                "-O3",
                "-march=native",
                "-fopenmp",
                "-ffp-contract=off",
                f"-DINLINELM_HEADERS={_headers()}",
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:  # NOTE: the compiler's boundary
        logger.warning("inlinelm's CPU kernels did not build (%s): torch's ops run instead", e)
        return None


def cpu_ops(device: torch.device, dtype: torch.dtype) -> Any:
    """The extension where its fused float32 kernels serve a ``dtype`` model on ``device``
    (a float32 model on a CPU, the extension built), else None."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return cpu_extension()


def _headers() -> str:
    digest = hashlib.sha256()
    for name in HEADERS:
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:16]
