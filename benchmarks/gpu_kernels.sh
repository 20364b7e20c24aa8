#!/usr/bin/env bash
# Build, on a CPU machine with nvcc 13.0 and network, FlashInfer 0.6.13's kernel modules for
# the H200 (sm_90a), so the GPU check loads them instead of compiling for minutes there.
#
#   benchmarks/gpu_kernels.sh [DEST]     # DEST defaults to .kernels/ at the repository root
#
# DEST is ignored by git and travels with the device call (`carry`); gpu_check.sh's install
# stage copies its modules into FlashInfer's AOT folder. The module list is
# benchmarks/gpu_kernels.py's (one parallel build_jit_specs call, ~1,000 CPU-seconds; run it
# under `nice -n 19` on a shared machine).
#
# What a CPU machine's pip-assembled toolkit lacks, and how it is supplied here:
#   - FlashInfer and tvm-ffi for this machine's Python: pip --target into the build folder
#     (the modules are tied to FlashInfer's and tvm-ffi's versions, not to Python's);
#   - cublasLt.h, cublas_v2.h, curand_kernel.h (norm and sampling include them): the headers
#     of the nvidia-cublas / nvidia-curand cu13 wheels, via FLASHINFER_EXTRA_CUDAFLAGS;
#   - libcuda.so for -lcuda (no module calls the driver API): an empty stub whose soname is
#     libcuda.so.1, the name every driver installs, via FLASHINFER_EXTRA_LDFLAGS.
#
# Environment: PYTHON (.venv/bin/python when present: it needs torch), CUDA_HOME
# (/usr/local/cuda), GPU_KERNELS_BUILD (/tmp/inlinelm-kernels-build: site, headers, stub,
# FlashInfer's workspace), MAX_JOBS (nproc). Fails if DEST passes 24 MiB.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$(mkdir -p "${1:-$ROOT/.kernels}" && cd "${1:-$ROOT/.kernels}" && pwd)"
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
    PYTHON="$ROOT/.venv/bin/python"
fi
PY="${PYTHON:-python3}"
BUILD="${GPU_KERNELS_BUILD:-/tmp/inlinelm-kernels-build}"
LIMIT_MIB=24
PACKAGES=(flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 einops tabulate nvidia-ml-py ninja)
HEADER_WHEELS=(nvidia-cublas==13.1.1.3 nvidia-curand==10.4.0.35)
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
mkdir -p "$BUILD"/{site,wheels,headers,stub,workspace}

# 1) FlashInfer and tvm-ffi (plus the small packages `import flashinfer` needs) for this Python
if [ ! -d "$BUILD/site/flashinfer" ]; then
    "$PY" -m pip install -q --no-deps --target "$BUILD/site" "${PACKAGES[@]}"
fi
# 2) the cuBLAS and cuRAND headers, from their wheels (the libraries are not needed)
if [ ! -f "$BUILD/headers/nvidia/cu13/include/cublasLt.h" ] ||
    [ ! -f "$BUILD/headers/nvidia/cu13/include/curand_kernel.h" ]; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$BUILD/wheels" "${HEADER_WHEELS[@]}"
    for wheel in "$BUILD"/wheels/nvidia_cublas-*.whl "$BUILD"/wheels/nvidia_curand-*.whl; do
        unzip -q -o "$wheel" 'nvidia/cu13/include/*' -d "$BUILD/headers"
    done
fi
# 3) the libcuda.so stub
if [ ! -f "$BUILD/stub/libcuda.so" ]; then
    echo 'void inlinelm_libcuda_stub(void) {}' >"$BUILD/stub/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$BUILD/stub/libcuda.so" "$BUILD/stub/stub.c"
fi

export PATH="$BUILD/site/bin:$CUDA_HOME/bin:$PATH"
export PYTHONPATH="$BUILD/site${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE="$BUILD/workspace" TVM_FFI_CACHE_DIR="$BUILD/workspace/tvm-ffi"
export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $BUILD/headers/nvidia/cu13/include"
export FLASHINFER_EXTRA_LDFLAGS="-L$BUILD/stub"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
"$PY" --version
nvcc --version | tail -1
start=$(date +%s)
"$PY" "$ROOT/benchmarks/gpu_kernels.py" build "$DEST"
echo "wall: $(($(date +%s) - start)) s"
total=$(du -sb "$DEST" | cut -f1)
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "$DEST passes ${LIMIT_MIB} MiB: the device call cannot carry it beside the wheels" >&2
    exit 1
fi
