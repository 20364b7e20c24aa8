#!/usr/bin/env bash
# Download, on a CPU machine with network, the wheels the GPU check installs on a device
# that has none: FlashInfer (pure Python, JIT-compiled there) and its ABI package, and the
# HTTP stack the router needs (absent from the device image; orjson frames its SSE, uvloop
# and httptools are what inlinelm serve runs). cp312 x86-64, no deps: the
# image already has torch, numpy, ninja, click, h11, anyio, httpx, prometheus-client
# (see /work/shared/notes/gpu.md §1 for why 0.6.13 and what else FlashInfer needs).
#
#   benchmarks/gpu_wheels.sh [DEST]      # DEST defaults to .whl/ at the repository root
#
# Prints each wheel and the total; fails if the total passes 60 MiB (the device call
# carries at most 64 MiB, code included).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PYTHON="${PYTHON:-python3}"
LIMIT_MIB=60
WHEELS=(
    flashinfer-python==0.6.13
    apache-tvm-ffi==0.1.15.post2
    starlette==1.10.0
    sse-starlette==3.7.0
    uvicorn==0.54.0
    anyio==4.16.0
    orjson==3.13.0
    uvloop==0.23.0
    httptools==0.9.0
)
mkdir -p "$DEST"
# NOTE: one version of each package only: two wheels of one name stop the whole install.
for spec in "${WHEELS[@]}"; do
    name="${spec%%==*}"
    stem="$(echo "$name" | tr '-' '_')"
    find "$DEST" -maxdepth 1 -name "${stem}-*.whl" ! -name "${stem}-${spec##*==}-*.whl" -delete
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$DEST" "${WHEELS[@]}"
total=0
for f in "$DEST"/*.whl; do
    size=$(stat -c %s "$f")
    total=$((total + size))
    awk -v s="$size" -v n="$(basename "$f")" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" -v d="$DEST" -v l="$LIMIT_MIB" \
    'BEGIN { printf "%8.2f MiB  total in %s (limit %d MiB)\n", s / 1048576, d, l }'
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "the wheels pass ${LIMIT_MIB} MiB: the device call cannot carry them" >&2
    exit 1
fi
