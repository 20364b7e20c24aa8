"""The Python stages of ``benchmarks/gpu_check.sh``: ``probe``, ``install``, ``jit``,
``attention``, ``twins``.

Each prints human-readable lines and, last, one ``@@data {json}`` line the check records.
``jit`` exits 3 (skipped) without a CUDA device.

* ``probe``: toolchain facts before anything is installed (nvidia-smi, nvcc, CUDA_HOME and
  the headers and driver stub FlashInfer's JIT needs, torch, CUDA, the dlpack exchange
  attribute tvm-ffi looks for).
* ``install WHEELS SITE KERNELS``: pip-installs the carried wheels into SITE, copies the
  prebuilt FlashInfer modules from KERNELS into FlashInfer's AOT folder and load-tests them
  (``benchmarks/gpu_kernels.py install``), then reports which packages import.
* ``jit``: builds every base FlashInfer module that is not prebuilt in one parallel call
  (``benchmarks/gpu_kernels.py``), then runs each kernel family once for the shapes the GPU
  tests and benchmarks use (head dim 64 with 3 and 4 query heads per KV head, 128 with 4).
* ``attention``: builds the families' attention modules not prebuilt (one parallel call),
  then runs each family shape of ``gpu_kernels.FAMILY_SHAPES`` (head dim 256; sliding and
  global layer kinds, soft-capped or not, a query scale not the head dim's) through
  ``FlashInferAttention``: a prefill step with cached prefixes and a decode step, one plan
  per kind, and the graphed decode of both kinds (a CUDA graph captured once, replayed
  for two steps), each against the torch backend in float32. Without CUDA the same runs
  through the CPU stand-in of ``flashinfer`` (``tests/gpu/fakes.py``) in float32.
* ``twins``: the node ids of the CPU tests standing in for the ``gpu`` tests, which the
  check's pytest stage runs where there is no CUDA device.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
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


_G = "tests/gpu/"
_A, _M, _S = _G + "attention/", _G + "model/", _G + "sampling/"  # tests/gpu's rooms
CPU_TWINS: dict[str, tuple[str, ...]] = {
    # gpu test -> the CPU tests that run the same path with a CPU device or a stand-in
    _G + "test_pooling_cuda.py::test_embeddings_and_scores_on_cuda_equal_the_cpu": (
        _G + "test_pooling_cuda.py::test_the_cuda_comparisons_run_on_a_cpu",
        "tests/pooling/test_pooling_engine.py::"
        + "test_embeddings_equal_sentence_transformers_in_one_ragged_batch",
        "tests/pooling/test_pooling_engine.py::"
        + "test_cross_encoder_scores_equal_transformers_sigmoid",
    ),
    _G + "test_pooling_cuda.py::test_prompt_logprobs_on_cuda_equal_the_cpu": (
        _G + "test_pooling_cuda.py::test_the_cuda_comparisons_run_on_a_cpu",
        "tests/runtime/test_prompt_logprobs.py::"
        + "test_prompt_logprobs_equal_transformers_in_chunks_beside_other_requests",
    ),
    _A + "test_attention_backends.py::test_page_table_attention_equals_torch_backend_on_cuda": (
        _A + "test_page_table.py::test_page_table_attention_equals_torch_backend",
    ),
    _A + "test_attention_backends.py::test_flashinfer_equals_torch_backend_on_cuda": (
        _A + "test_attention_backends.py::test_flashinfer_glue_plans_once_and_matches_torch",
    ),
    _A + "test_attention_backends.py::test_flashinfer_layer_kinds_equal_torch_backend_on_cuda": (
        _A
        + "test_attention_backends.py::"
        + "test_flashinfer_glue_plans_each_kind_once_per_step_and_matches_torch",
    ),
    _A
    + "test_attention_backends.py::test_flashinfer_graph_attention_with_two_kinds_replays_on_cuda": (
        _A
        + "test_attention_backends.py::"
        + "test_the_flashinfer_graph_attention_plans_every_kind_before_a_replay_and_matches_torch",
    ),
    _A + "test_attention_backends.py::test_auto_picks_flashinfer_on_cuda_when_installed": (
        _A + "test_attention_backends.py::test_auto_on_cuda_is_flashinfer_when_it_imports",
    ),
    _G + "test_cuda_graphs.py::test_graph_replay_equals_eager_at_every_size_on_cuda": (
        _G + "test_cuda_graphs.py::test_static_step_tokens_equal_the_dynamic_path_at_every_size",
    ),
    _M + "test_kernels.py::test_flashinfer_kernels_equal_the_torch_ones_on_cuda": (
        _M + "test_kernels.py::test_flashinfer_kernels_wiring_matches_torch_on_a_stand_in",
    ),
    _G + "test_model_cuda.py::test_cuda_logits_equal_the_cpu_model": (
        _G + "test_model_cuda.py::test_a_cpu_runner_is_float32_with_torch_kernels_and_attention",
    ),
    _G + "test_model_cuda.py::test_close_returns_gpu_memory_and_a_second_runner_starts": (
        _G + "test_model_cuda.py::test_close_drops_the_model_and_cache_and_is_idempotent",
    ),
    _G + "test_model_cuda.py::test_a_second_engine_starts_and_generates_after_the_first_closes": (
        "tests/runtime/test_lifecycle.py::test_close_frees_the_runner_even_while_the_engine_object_lives",
    ),
    _G + "test_pipelined_runner.py::test_pipelined_greedy_equals_plain_on_cuda": (
        _G + "test_pipelined_runner.py::test_abort_in_flight",
        _G + "test_pipelined_runner.py::test_pipelined_static_decode_equals_plain",
    ),
    _S + "test_sampler.py::test_seed_is_batch_invariant_on_cuda_at_full_size": (
        _S + "test_sampler.py::test_seed_gives_the_same_tokens_whatever_the_batch_and_row",
    ),
    _M + "test_moe.py::test_the_grouped_bf16_cuda_path_equals_the_float32_cpu_path": (
        _M + "test_moe.py::test_the_grouped_path_in_bf16_on_the_cpu_is_within_the_bf16_bound",
    ),
    _M + "test_moe.py::test_a_cuda_graph_replays_the_layer_with_new_inputs": (
        _M + "test_moe.py::test_the_grouped_path_runs_torch_grouped_mm_on_the_cpu",
        _M + "test_moe.py::test_the_routing_of_grouped_experts_matches_a_hand_computed_case",
    ),
    _G + "test_families_cuda.py::test_a_family_on_cuda_decodes_as_transformers": (
        _M
        + "test_families.py::"
        + "test_engine_greedy_matches_transformers_through_chunks_prefix_hits_and_preemption",
        _G
        + "test_cuda_graphs.py::test_static_step_tokens_equal_the_dynamic_path_for_each_layer_kind",
    ),
    _G + "test_gpu_engine.py::test_greedy_is_the_same_in_every_mode_and_equals_transformers": (
        _G + "test_model_runner.py::test_greedy_equals_transformers",
    ),
    _G + "test_gpu_engine.py::test_256_streams_through_the_runtime_on_cuda": (
        "tests/runtime/test_engine_streams.py::test_1000_concurrent_streams_each_get_exactly_their_text",
    ),
    _G + "test_gpu_engine.py::test_256_sse_streams_through_the_router_on_cuda": (
        "tests/api/test_sse.py::test_chat_stream_shape_silent_steps_and_usage",
    ),
    _G + "test_gpu_engine.py::test_device_memory_is_returned_on_close": (
        "tests/runtime/test_lifecycle.py::test_close_frees_the_runner_even_while_the_engine_object_lives",
    ),
}
"""Each ``gpu`` test and its CPU twins: what the check's pytest stage runs without CUDA
(``tests/test_gpu_check.py`` holds every twin to exist and to run without CUDA)."""


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


def package_versions(names: tuple[str, ...] = OPTIONAL_PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(name)
            version = str(getattr(module, "__version__", "?"))
            versions[name] = f"{version} ({time.perf_counter() - t0:.1f} s)"
        except Exception as e:
            versions[name] = f"missing: {type(e).__name__}: {e}"[:200]
    return versions


JIT_NEEDS = ("include/cublasLt.h", "include/cublas_v2.h", "include/curand_kernel.h")
DRIVER_STUB = "lib64/stubs/libcuda.so"


def toolkit_gaps(cuda_home: str) -> list[str]:
    """What FlashInfer's JIT needs under ``cuda_home`` and does not find: the cuBLAS and
    cuRAND headers (norm and sampling include them) and the driver stub ``-lcuda`` links."""
    return [f for f in (*JIT_NEEDS, DRIVER_STUB) if not os.path.exists(os.path.join(cuda_home, f))]


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
        "cuda_home_missing": toolkit_gaps(cuda_home) if cuda_home else "no CUDA_HOME",
        "wheel_headers": wheel_headers(),
        "nproc": os.cpu_count(),
        "packages_pre_install": package_versions(("transformers", "triton", "pytest")),
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


def wheel_headers() -> str | None:
    """The include folder of the nvidia cu13 wheels torch depends on, if it has the cuBLAS
    and cuRAND headers (the JIT's fallback where ``CUDA_HOME`` lacks them)."""
    try:
        import nvidia  # type: ignore[import-not-found]  # the CUDA wheels' namespace package
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        include = os.path.join(root, "cu13", "include")
        if all(os.path.exists(os.path.join(include, os.path.basename(f))) for f in JIT_NEEDS):
            return include
    return None


def install(wheels: str, site: str, kernels: str) -> int:
    """pip-install ``wheels/*.whl`` into ``site``, place the prebuilt modules, report packages."""
    files = sorted(str(p) for p in Path(wheels).glob("*.whl"))
    data: dict[str, Any] = {"wheels": len(files)}
    if not files:
        print(f"no wheels in {wheels} (run benchmarks/gpu_wheels.sh)")
        data["packages"] = package_versions()
        emit(data)
        return 0
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    pip += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", site]
    cross = sys.version_info[:2] != (3, 12)
    if cross:  # a rehearsal on another Python: unpack the cp312 wheels to prove them
        pip += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
        pip += ["--only-binary=:all:", "--platform", "any"]
        pip += [f"--platform={p}_x86_64" for p in ("manylinux_2_28", "manylinux_2_24")]
        pip += ["--platform=manylinux_2_17_x86_64", "--platform=manylinux2014_x86_64"]
    t0 = time.perf_counter()
    done = subprocess.run([*pip, *files], capture_output=True, text=True, check=False)
    data["pip_s"] = time.perf_counter() - t0
    print((done.stdout + done.stderr).strip()[-2000:])
    if done.returncode != 0:
        data["pip_rc"] = done.returncode
        emit(data)
        return 1
    if cross:
        data["kernels"] = "not placed: the cp312 packages do not import on this Python"
    else:
        sys.path.insert(0, site)
        data["kernels"] = place_kernels(kernels)
    data["packages"] = package_versions()
    for key, value in data.items():
        print(f"{key}: {value}")
    emit(data)
    return 0


def place_kernels(kernels: str) -> dict[str, Any]:
    """The prebuilt FlashInfer modules copied into its AOT folder and load-tested (all or
    none stay; see ``gpu_kernels.install``)."""
    import torch  # noqa: F401  # NOTE: first: the modules need the CUDA runtime it loads

    import gpu_kernels

    return gpu_kernels.install(Path(kernels))


def jit() -> int:
    import torch

    if not torch.cuda.is_available():
        print("jit: skipped: no CUDA")
        emit({"status": "skipped", "reason": "no CUDA"})
        return SKIPPED_EXIT
    t0 = time.perf_counter()
    import flashinfer

    import gpu_kernels

    data: dict[str, Any] = {
        "flashinfer": flashinfer.__version__,
        "import_s": time.perf_counter() - t0,
        "workspace_base": os.environ.get("FLASHINFER_WORKSPACE_BASE"),
        "arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
        "toolkit_fallbacks": toolkit_fallbacks(),
        "shapes": [],
    }
    failed = False
    try:
        data["build"] = gpu_kernels.jit(gpu_kernels.base_specs())
    except Exception as e:
        data["build"] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        failed = True
    print(data["build"], flush=True)
    for name, run in (("kernels", warm_kernels), ("sampling", warm_sampling)):
        try:
            data[name] = run()
        except Exception as e:
            data[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
            failed = True
        print(name, data[name], flush=True)
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


def toolkit_fallbacks() -> dict[str, str]:
    """Point FlashInfer's JIT at what ``CUDA_HOME`` lacks (D8 of the GPU review): the cuBLAS
    and cuRAND headers of torch's CUDA wheels, and an empty ``libcuda.so.1`` stub for
    ``-lcuda`` (no module calls the driver API). Returns the flags set."""
    gaps = toolkit_gaps(os.environ.get("CUDA_HOME", ""))
    flags: dict[str, str] = {}
    headers = wheel_headers()
    if any(g.startswith("include/") for g in gaps) and headers:
        flags["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-isystem {headers}"
    if DRIVER_STUB in gaps:
        stub = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", "/tmp")) / "libcuda-stub"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "stub.c").write_text("void inlinelm_libcuda_stub(void) {}\n")
        compile_stub = ["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"]
        subprocess.run([*compile_stub, str(stub / "libcuda.so"), str(stub / "stub.c")], check=True)
        flags["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{stub}"
    for key, value in flags.items():
        os.environ[key] = f"{os.environ.get(key, '')} {value}".strip()
    return {"missing": ", ".join(gaps), **flags}


def warm_kernels() -> dict[str, float]:
    """RMSNorm, fused add + RMSNorm, SiLU-and-mul and RoPE once each (SmolLM2's sizes)."""
    import torch

    from inlinelm.gpu.model.kernels import FlashInferKernels

    t0 = time.perf_counter()
    device, dtype, tokens = torch.device("cuda"), torch.bfloat16, 7
    kernels = FlashInferKernels()
    x = torch.randn(tokens, 576, device=device, dtype=dtype)
    weight = torch.ones(576, device=device, dtype=dtype)
    kernels.rms_norm(x, weight, 1e-5)
    kernels.add_rms_norm(x.clone(), x.clone(), weight, 1e-5)
    kernels.silu_and_mul(torch.randn(tokens, 2 * 1536, device=device, dtype=dtype))
    qk = torch.randn(tokens, 12, 64, device=device, dtype=dtype)
    table = torch.randn(4096, 64, device=device)
    positions = torch.arange(tokens, device=device)
    kernels.apply_rope(qk, 9, kernels.rope_inputs(table, positions, dtype))
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0}


def warm_sampling() -> dict[str, float]:
    """Each sampling kernel the sampler calls, once."""
    import torch

    from inlinelm.gpu.sampling.sampler import FlashInferSampling

    t0 = time.perf_counter()
    probs = torch.softmax(torch.randn(4, 49152, device="cuda"), dim=-1)
    top_k = torch.full((4,), 50, device="cuda")
    top_p = torch.full((4,), 0.9, device="cuda")
    sample = FlashInferSampling()
    for k, p in ((None, None), (top_k, None), (None, top_p), (top_k, top_p)):
        sample(probs, k, p)
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0}


def warm_shape(heads: int, kv_heads: int, head_dim: int) -> dict[str, float]:
    """One prefill (2 sequences, 20 and 5 tokens) and one decode step; seconds for each."""
    import torch

    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention
    from inlinelm.gpu.attention.metadata import AttentionMetadata, LayerAttention

    device, dtype, page = torch.device("cuda"), torch.bfloat16, 16
    plain = LayerAttention(head_dim**-0.5)
    backend = FlashInferAttention(heads, kv_heads, head_dim, dtype, device, [plain])
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
        out = backend.forward(q, k, k.clone(), cache, meta, plain)
        torch.cuda.synchronize()
        assert out.shape == (t, heads, head_dim) and bool(torch.isfinite(out).all())
        timings[f"{kind}_s"] = time.perf_counter() - t0
    return timings


ATTENTION_STEPS = {
    # (cached prefix, new tokens) per request: chunks after prefixes, past the windows of 8
    "prefill": [(0, 37), (20, 1), (16, 16), (5, 11), (100, 3)],
    "decode": [(n, 1) for n in (0, 7, 8, 15, 16, 17, 63, 200)],
}
GRAPH_STEPS = ([(0, 1), (15, 1), (40, 1), (7, 1)], [(30, 1), (2, 1), (16, 1), (55, 1)])
ATTENTION_ATOL = {"cuda": 3e-2, "cpu": 1e-4}  # bf16 on the device, float32 on the stand-in


def attention() -> int:
    """The families' layer kinds through ``FlashInferAttention`` against the torch backend
    (real FlashInfer in bf16 on CUDA; the CPU stand-in in float32 elsewhere)."""
    import torch

    import gpu_kernels

    cuda = torch.cuda.is_available()
    data: dict[str, Any] = {"device": "cuda" if cuda else "cpu (stand-in flashinfer)"}
    failed = False
    if cuda:
        try:
            data["build"] = gpu_kernels.jit(gpu_kernels.family_specs())
        except Exception as e:
            data["build"] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            failed = True
        print(data["build"], flush=True)
    else:
        use_stand_in_flashinfer()
    data["shapes"] = []
    for name, (heads, kv_heads, head_dim, kinds) in gpu_kernels.FAMILY_SHAPES.items():
        row: dict[str, Any] = {"shape": name, "heads": heads, "kv_heads": kv_heads}
        row.update(head_dim=head_dim, kinds=[list(kind) for kind in kinds])
        try:
            row.update(attend_kinds(heads, kv_heads, head_dim, kinds, cuda))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:800]
        failed |= "error" in row
        data["shapes"].append(row)
        print(row, flush=True)
    emit(data)
    return 1 if failed else 0


def use_stand_in_flashinfer() -> None:
    """``import flashinfer`` gives the CPU stand-in of the tests (as their fixture does)."""
    from tests.gpu.fakes import fake_flashinfer_module

    from inlinelm.gpu.attention import flashinfer_backend

    sys.modules["flashinfer"] = fake_flashinfer_module()
    flashinfer_backend.WORKSPACE_BYTES = 1024


def attend_kinds(
    heads: int, kv_heads: int, head_dim: int, kinds: tuple[Any, ...], cuda: bool
) -> dict[str, Any]:
    """The largest error against the torch backend of each step (eager prefill and
    decode: the kinds alternating over three layers; graphed decode: every kind a layer),
    and the seconds each took (the first of each loads its modules)."""
    import torch
    from tests.gpu.attention.kind_steps import eager_results, graph_results
    from tests.gpu.paged_steps import Shape, make_step

    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention
    from inlinelm.gpu.attention.metadata import LayerAttention

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layer_kinds = [LayerAttention(*kind) for kind in kinds]
    layers = [*layer_kinds, layer_kinds[0]]
    backend = FlashInferAttention(heads, kv_heads, head_dim, dtype, device, layers)
    shape = Shape(16, heads, kv_heads, head_dim)
    errors: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for name, requests in ATTENTION_STEPS.items():
        t0 = time.perf_counter()
        steps = [
            make_step(shape, requests, 0, data_seed=i, dtype=dtype, device=device)
            for i in range(len(layers))
        ]
        errors[name] = _largest_error(eager_results(backend, layers, steps, 16))
        seconds[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = backend.make_graph_attention(4, 256, 16, device)
    graph.init_capture_graph([1, 2, 4])
    steps = [
        make_step(shape, requests, i, dtype=dtype, device=device)
        for i, requests in enumerate(GRAPH_STEPS)
    ]
    results = graph_results(backend, graph, layer_kinds, steps, capture=cuda)
    graph.close()
    errors["graph_decode"] = _largest_error(results)
    seconds["graph_decode"] = time.perf_counter() - t0
    row: dict[str, Any] = {"max_abs_error": errors, "seconds": seconds}
    atol = ATTENTION_ATOL[device.type]
    if max(errors.values()) > atol:
        row["error"] = f"an output differs from the torch backend's by more than {atol}"
    return row


def _largest_error(results: list[tuple[Any, Any, Any]]) -> float:
    return max(float((out.float() - expected).abs().max()) for _, out, expected in results)


def twins() -> int:
    """Print the CPU twins' node ids, one a line (for the check's pytest stage)."""
    for node in sorted({twin for pair in CPU_TWINS.values() for twin in pair}):
        print(node)
    return 0


def main() -> int:
    stages: dict[str, tuple[Callable[..., int], int]] = {
        "probe": (probe, 0),
        "install": (install, 3),
        "jit": (jit, 0),
        "attention": (attention, 0),
        "twins": (twins, 0),
    }
    if len(sys.argv) < 2 or sys.argv[1] not in stages:
        print(f"usage: {sys.argv[0]} {{{','.join(stages)}}} [ARGS]", file=sys.stderr)
        return 2
    run, num_args = stages[sys.argv[1]]
    if len(sys.argv) != 2 + num_args:
        print(f"usage: {sys.argv[0]} install WHEELS SITE KERNELS", file=sys.stderr)
        return 2
    return run(*sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
