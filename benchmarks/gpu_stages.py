"""The Python stages of ``benchmarks/gpu_check.sh``: ``probe`` and ``jit``.

Each prints human-readable lines and, last, one ``@@data {json}`` line the check records.
``jit`` exits 3 (skipped) without a CUDA device.

* ``probe``: toolchain and package facts (nvidia-smi, nvcc, CUDA_HOME layout, torch, CUDA,
  the dlpack exchange attribute tvm-ffi looks for, and which optional packages import).
* ``jit``: builds FlashInfer's kernels once for the shapes the GPU tests and benchmarks use
  (head dim 64 with 3 and 4 query heads per KV head, head dim 128 with 4), by running one
  paged prefill and one decode through inlinelm's FlashInfer backend; later stages in the
  same call find them in ``FLASHINFER_WORKSPACE_BASE``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

SKIPPED_EXIT = 3
JIT_SHAPES = [(9, 3, 64), (8, 2, 64), (32, 8, 128)]  # query heads, KV heads, head dim
OPTIONAL_PACKAGES = (
    "flashinfer",
    "tvm_ffi",
    "starlette",
    "sse_starlette",
    "uvicorn",
    "orjson",
    "uvloop",
    "httptools",
    "anyio",
    "httpx",
    "prometheus_client",
    "transformers",
    "safetensors",
    "tokenizers",
    "triton",
    "pytest",
)


def emit(data: dict[str, Any]) -> None:
    print("@@data " + json.dumps(data, default=str), flush=True)


def command(*args: str) -> str:
    if shutil.which(args[0]) is None:
        return f"{args[0]}: not found"
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return f"{args[0]}: timed out"
    return (done.stdout + done.stderr).strip()[-800:]


def package_versions() -> dict[str, str]:
    versions = {}
    for name in OPTIONAL_PACKAGES:
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(name)
            version = str(getattr(module, "__version__", "?"))
            versions[name] = f"{version} ({time.perf_counter() - t0:.1f} s)"
        except Exception as e:
            versions[name] = f"missing: {type(e).__name__}: {e}"[:200]
    return versions


def probe() -> int:
    import torch

    cuda_home = os.environ.get("CUDA_HOME", "")
    facts: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
        "nvidia_smi": command("nvidia-smi", "-L"),
        "nvcc": command("nvcc", "--version").splitlines()[-1:],
        "tools": {t: shutil.which(t) for t in ("nvcc", "ninja", "c++", "gcc")},
        "cuda_home": cuda_home,
        "cuda_home_libcudart": sorted(
            f for f in os.listdir(os.path.join(cuda_home, "lib64")) if f.startswith("libcudart")
        )
        if cuda_home and os.path.isdir(os.path.join(cuda_home, "lib64"))
        else "no lib64",
        "nproc": os.cpu_count(),
        "packages": package_versions(),
    }
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        facts.update(
            device=torch.cuda.get_device_name(),
            capability=torch.cuda.get_device_capability(),
            memory_free_gib=free / 2**30,
            memory_total_gib=total / 2**30,
        )
    for key, value in facts.items():
        print(f"{key}: {value}")
    emit(facts)
    return 0


def jit() -> int:
    import torch

    if not torch.cuda.is_available():
        print("jit: skipped: no CUDA")
        emit({"status": "skipped", "reason": "no CUDA"})
        return SKIPPED_EXIT
    t0 = time.perf_counter()
    import flashinfer

    data: dict[str, Any] = {
        "flashinfer": flashinfer.__version__,
        "import_s": time.perf_counter() - t0,
        "workspace_base": os.environ.get("FLASHINFER_WORKSPACE_BASE"),
        "arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
        "shapes": [],
    }
    failed = False
    for heads, kv_heads, head_dim in JIT_SHAPES:
        row: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        try:
            row.update(warm_shape(heads, kv_heads, head_dim))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:800]
            failed = True
        data["shapes"].append(row)
        print(row, flush=True)
    data["total_s"] = time.perf_counter() - t0
    emit(data)
    return 1 if failed else 0


def warm_shape(heads: int, kv_heads: int, head_dim: int) -> dict[str, float]:
    """One prefill (2 sequences, 20 and 5 tokens) and one decode step; seconds for each."""
    import torch

    from inlinelm.gpu.attention import AttentionMetadata
    from inlinelm.gpu.flashinfer_backend import FlashInferAttention

    device, dtype, page = torch.device("cuda"), torch.bfloat16, 16
    backend = FlashInferAttention(heads, kv_heads, head_dim, dtype, device)
    cache = torch.zeros(2, 8 * page, kv_heads, head_dim, dtype=dtype, device=device)
    timings = {}
    for kind, lens, new in (("prefill", [20, 5], [20, 5]), ("decode", [21, 6], [1, 1])):
        t0 = time.perf_counter()
        table = [[0, 1], [2, 3]]
        slots = [
            table[i][p // page] * page + p % page
            for i, n in enumerate(lens)
            for p in range(n - new[i], n)
        ]
        starts = [0, new[0], new[0] + new[1]]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(starts, device=device),
            seq_lens=torch.tensor(lens, device=device),
            block_tables=torch.tensor(table, device=device),
            max_query_len=max(new),
            max_seq_len=max(lens),
        )
        backend.prepare(meta, page)
        t = sum(new)
        q = torch.randn(t, heads, head_dim, dtype=dtype, device=device)
        k = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=device)
        out = backend.forward(q, k, k.clone(), cache, meta)
        torch.cuda.synchronize()
        assert out.shape == (t, heads, head_dim) and bool(torch.isfinite(out).all())
        timings[f"{kind}_s"] = time.perf_counter() - t0
    return timings


def main() -> int:
    stages = {"probe": probe, "jit": jit}
    if len(sys.argv) != 2 or sys.argv[1] not in stages:
        print(f"usage: {sys.argv[0]} {{{','.join(stages)}}}", file=sys.stderr)
        return 2
    return stages[sys.argv[1]]()


if __name__ == "__main__":
    sys.exit(main())
