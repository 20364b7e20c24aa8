"""FlashInfer's kernel modules for the GPU check: built ahead of time here, or on the device.

FlashInfer compiles each kernel family with nvcc on first use, which costs minutes of a
device call (about 1,000 CPU-seconds for the modules below). This module names the modules
the engine selects for the check's shapes, once, for both ways of having them:

* ``build DEST``: build every module in one parallel ``build_jit_specs`` call (on a CPU
  machine with nvcc; see ``benchmarks/gpu_kernels.sh`` for the toolchain it needs) and copy
  each to ``DEST/<uri>/<uri>.so``, with ``DEST/manifest.json`` (versions, arch, sizes, SHA-256).
* ``install SRC``: copy prebuilt modules into FlashInfer's AOT folder
  (``flashinfer/data/aot/<uri>/<uri>.so``, where ``JitSpec.is_aot`` looks first) and load each
  with ``tvm_ffi.load_module``; if any is missing, mismatched or fails to load, remove every
  copied one, so the ``jit`` stage builds them all.
* ``jit``: build every module that is not prebuilt, in one ``build_jit_specs`` call (ninja
  runs all their translation units in parallel; a module alone would cost its slowest one).

Modules: the base ones (:func:`base_specs`): norm (RMSNorm and its fused add, Gemma's
too), rope, silu_and_mul, sampling, page (KV append), and FA2 paged decode and prefill in
bf16 for head dims 64 (SmolLM2, 9/3 heads) and 128 (Llama-3-8B, 32/8 heads: its decode
runs the prefill kernel, 4 query heads per KV head); and the families' (:func:`family_specs`):
gelu_tanh_and_mul and the attention variants :data:`FAMILY_SHAPES` select. FlashInfer
compiles a sliding window (``use_swa``) and a soft cap (``use_logits_cap``) into the kernel,
so each layer kind of a family is a module of its own per head dim: Gemma 2's sliding and
global layers, both capped, at head dim 256 with 2 query heads per KV head (the CUDA-core
decode kernel and the prefill kernel), and Gemma 3's, uncapped, with 4 (decode on the
prefill kernel). The jit stage builds the base ones, the attention stage the families'.
Each command prints one ``@@data {json}`` line last (see ``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HEAD_DIMS = (64, 128)
MANIFEST = "manifest.json"

Kind = tuple[float, int | None, float | None]
"""A layer kind as the check writes it: (query scale, sliding window or None, soft cap or None)."""

FAMILY_SHAPES: dict[str, tuple[int, int, int, tuple[Kind, ...]]] = {
    # name: (query heads, KV heads, head dim, the distinct layer kinds)
    # Gemma 2 2B's heads (2 per KV head: CUDA-core decode); 27B's query scale (its
    # query_pre_attn_scalar 144, not the head dim); a cap of 2 bites on random data (the
    # models' 50 does not; the value is not compiled in)
    "gemma2": (8, 4, 256, ((144**-0.5, 8, 2.0), (144**-0.5, None, 2.0))),
    # Gemma 3 1B's heads (4 per KV head: decode on the prefill kernel), no cap
    "gemma3": (4, 1, 256, ((256**-0.5, 8, None), (256**-0.5, None, None))),
}
"""The layer kinds the check runs through FlashInfer (the attention stage, and the gpu
tests' ``CUDA_FAMILY_SHAPES``); the windows are short so that test contexts cross them."""


def emit(data: dict[str, Any]) -> None:
    print("@@data " + json.dumps(data, default=str), flush=True)


def kernel_specs() -> list[Any]:
    """The ``JitSpec`` of every module the check loads: the base ones and the families'."""
    return base_specs() + family_specs()


def base_specs() -> list[Any]:
    """The modules of the two benchmark shapes: the model's kernels, sampling, the KV
    append, and plain attention at head dims 64 and 128."""
    import torch
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module

    bf16, index = torch.bfloat16, torch.int32
    specs = [
        gen_norm_module(),
        gen_rope_module(),
        gen_act_and_mul_module("silu"),
        gen_sampling_module(),
        gen_page_module(),
    ]
    for d in HEAD_DIMS:
        # NOTE: the arguments FlashInfer's wrappers pass for our plans: no positional
        # encoding (RoPE is the model's), no sliding window, no soft cap, fp32 QK reduction.
        specs.append(gen_batch_decode_module(bf16, bf16, bf16, index, d, d, 0, False, False))
        specs.append(
            gen_batch_prefill_module("fa2", bf16, bf16, bf16, index, d, d, 0, False, False, False)
        )
    return specs


def family_specs() -> list[Any]:
    """Gemma's gated GELU and the attention modules of :data:`FAMILY_SHAPES`' kinds, each
    once (a module is a head dim, a window or none, a cap or none)."""
    from flashinfer.jit.activation import gen_act_and_mul_module

    specs = [gen_act_and_mul_module("gelu_tanh")]
    for heads, kv_heads, head_dim, kinds in FAMILY_SHAPES.values():
        for _, window, cap in kinds:
            specs += attention_specs(heads, kv_heads, head_dim, window is not None, cap is not None)
    return list({spec.name: spec for spec in specs}.values())


def attention_specs(
    heads: int, kv_heads: int, head_dim: int, use_swa: bool, use_cap: bool
) -> list[Any]:
    """The modules a kind's plans select, as FlashInfer's wrappers pick them: the FA2
    prefill module, and the CUDA-core decode module unless decode runs on tensor cores
    (the backend's rule: 4 query heads per KV head or more)."""
    import torch
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module

    from inlinelm.gpu.attention.flashinfer_backend import TENSOR_CORE_DECODE_MIN_GROUP

    bf16, index, d = torch.bfloat16, torch.int32, head_dim
    specs = [
        gen_batch_prefill_module("fa2", bf16, bf16, bf16, index, d, d, 0, use_swa, use_cap, False)
    ]
    if heads // kv_heads < TENSOR_CORE_DECODE_MIN_GROUP:
        specs.append(gen_batch_decode_module(bf16, bf16, bf16, index, d, d, 0, use_swa, use_cap))
    return specs


def versions() -> dict[str, str]:
    """What a prebuilt module is tied to: FlashInfer, tvm-ffi and the target arch."""
    import flashinfer

    tvm_ffi = importlib.import_module("tvm_ffi")
    return {
        "flashinfer": str(flashinfer.__version__),
        "tvm_ffi": str(getattr(tvm_ffi, "__version__", "?")),
        "arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST", ""),
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build(dest: Path) -> int:
    """Build every module (one ninja run), copy them to ``dest`` with a manifest."""
    from flashinfer.jit import build_jit_specs

    specs = kernel_specs()
    t0 = time.perf_counter()
    build_jit_specs(specs, verbose=False, skip_prebuilt=False)
    seconds = time.perf_counter() - t0
    if dest.exists():
        shutil.rmtree(dest)
    modules = {}
    for spec in specs:
        target = dest / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True)
        shutil.copy2(spec.jit_library_path, target)
        modules[spec.name] = {"bytes": target.stat().st_size, "sha256": sha256(target)}
        print(f"{target.stat().st_size / 2**20:8.2f} MiB  {spec.name}")
    total = sum(m["bytes"] for m in modules.values())
    manifest = {**versions(), "build_s": round(seconds, 1), "bytes": total, "modules": modules}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{total / 2**20:8.2f} MiB  in {dest} ({len(modules)} modules, {seconds:.0f} s)")
    emit({"build_s": seconds, "bytes": total, "modules": len(modules)})
    return 0


def install(src: Path) -> dict[str, Any]:
    """Copy prebuilt modules into FlashInfer's AOT folder and load each; all or none stay.
    Returns what was done: ``status``, ``loaded`` (module, seconds), ``errors``."""
    from flashinfer.jit import env as jit_env

    tvm_ffi = importlib.import_module("tvm_ffi")

    aot = Path(jit_env.FLASHINFER_AOT_DIR)
    data: dict[str, Any] = {"source": str(src), "aot_dir": str(aot), "loaded": [], "errors": []}
    manifest_path = src / MANIFEST
    if not manifest_path.is_file():
        data["status"] = f"no prebuilt modules ({manifest_path} missing): the jit stage builds them"
        return data
    manifest = json.loads(manifest_path.read_text())
    here = versions()
    mismatch = {k: (manifest.get(k), v) for k, v in here.items() if manifest.get(k) != v}
    placed: list[Path] = []
    if mismatch:
        data["errors"].append(f"built for other versions (built, here): {mismatch}")
    else:
        for spec in kernel_specs():
            data["errors"].extend(_place(spec, src, manifest, placed))
        for path in placed:
            t0 = time.perf_counter()
            try:
                tvm_ffi.load_module(str(path))
                data["loaded"].append(
                    {"module": path.parent.name, "load_s": time.perf_counter() - t0}
                )
            except Exception as e:
                data["errors"].append(f"{path.parent.name}: {type(e).__name__}: {e}"[:500])
    if data["errors"]:
        for path in placed:
            shutil.rmtree(path.parent, ignore_errors=True)
        data["loaded"] = []
        data["status"] = "prebuilt modules removed: the jit stage builds every module"
    else:
        data["status"] = f"{len(placed)} prebuilt modules loaded"
    return data


def _place(spec: Any, src: Path, manifest: dict[str, Any], placed: list[Path]) -> list[str]:
    """Copy one module into the AOT folder after checking it against the manifest."""
    source = src / spec.name / f"{spec.name}.so"
    expected = manifest.get("modules", {}).get(spec.name)
    if expected is None or not source.is_file():
        return [f"{spec.name}: not prebuilt"]
    if sha256(source) != expected["sha256"]:
        return [f"{spec.name}: SHA-256 differs from the manifest"]
    target = Path(spec.aot_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
    placed.append(target)
    return []


def jit(specs: list[Any] | None = None) -> dict[str, Any]:
    """Build every module of ``specs`` (default: all) not prebuilt in one
    ``build_jit_specs`` call; what was done."""
    from flashinfer.jit import build_jit_specs

    specs = kernel_specs() if specs is None else specs
    missing = [s.name for s in specs if not s.is_aot]
    t0 = time.perf_counter()
    build_jit_specs(specs, verbose=os.environ.get("FLASHINFER_JIT_VERBOSE") == "1")
    return {
        "modules": len(specs),
        "prebuilt": len(specs) - len(missing),
        "built": missing,
        "build_s": time.perf_counter() - t0,
    }


def main() -> int:
    commands = {"build": 1, "install": 1, "jit": 0}
    if (
        len(sys.argv) < 2
        or sys.argv[1] not in commands
        or len(sys.argv) != 2 + commands[sys.argv[1]]
    ):
        print(f"usage: {sys.argv[0]} build DEST | install SRC | jit", file=sys.stderr)
        return 2
    if sys.argv[1] == "build":
        return build(Path(sys.argv[2]))
    data = install(Path(sys.argv[2])) if sys.argv[1] == "install" else jit()
    for line in (data.get("status", ""), *data.get("errors", [])):
        print(line)
    emit(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
