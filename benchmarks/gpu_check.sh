#!/usr/bin/env bash
# The one-call GPU check: every GPU stage of inlinelm in one command of under 8 minutes on a
# fresh, offline CUDA machine (an H200 with torch 2.11 + nvcc; see benchmarks/README.md).
#
#   benchmarks/gpu_check.sh OUTDIR
#
# Stages, in order, each a subprocess under its own `timeout` (clipped to what is left of
# GPU_CHECK_BUDGET_S, default 470 s): probe (toolchain facts), install (the wheels from
# .whl/, see benchmarks/gpu_wheels.sh; the prebuilt FlashInfer modules from .kernels/, see
# benchmarks/gpu_kernels.sh, placed and load-tested; then which packages import), jit (every
# base FlashInfer module not prebuilt, in one parallel build; each kernel family run once),
# attention (the families' attention modules not prebuilt, then their layer kinds through
# FlashInferAttention against the torch backend: windows, soft caps, head dim 256, eager
# and graphed), gpu_decode, gpu_e2e, pytest (-m gpu tests/gpu). After each stage one JSON line is appended
# to OUTDIR/stages.jsonl:
#   {"stage", "status": ok|skipped: ...|failed|timeout, "rc", "seconds", "limit_s", "data", "tail"}
# so a kill keeps what finished. OUTDIR also gets check.log (every stage's output),
# pytest.xml, gpu_decode.json and gpu_e2e.json.
#
# Without CUDA the check is a rehearsal of the same code: gpu_decode and gpu_e2e run on the
# CPU at tiny shapes (--rehearsal: the static decode step uncaptured, the pipelined engine
# loop, the HTTP clients of the idle measurement), attention runs through the CPU stand-in
# of flashinfer (tests/gpu/fakes.py), the pytest stage runs the CPU twins of
# the gpu tests (benchmarks/gpu_stages.py twins), jit reports "skipped: no CUDA". Exit
# status: 0 when every stage is ok or skipped, 1 when one failed or timed out, 2 for a
# usage error.
#
# Environment: PYTHON (.venv/bin/python when present, else python3), GPU_CHECK_BUDGET_S (470), GPU_CHECK_STAGES (a space-separated
# subset to rerun, e.g. "install jit gpu_decode"; the others report "skipped: not in
# GPU_CHECK_STAGES"; later stages need install), GPU_CHECK_WHEELS (.whl), GPU_CHECK_KERNELS
# (.kernels), GPU_CHECK_SITE (/tmp/inlinelm-gpu-site), GPU_CHECK_CACHE (/tmp/inlinelm-gpu-cache:
# FlashInfer's JIT cache).
set -u
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
cd "$ROOT"
# NOTE: the project's venv when there is one (a CPU rehearsal here); the system Python on
# the device, where the carried tree has no .venv and torch is preinstalled.
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
    PYTHON="$ROOT/.venv/bin/python"
fi
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
KERNELS="${GPU_CHECK_KERNELS:-$ROOT/.kernels}"
SITE="${GPU_CHECK_SITE:-/tmp/inlinelm-gpu-site}"
CACHE="${GPU_CHECK_CACHE:-/tmp/inlinelm-gpu-cache}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
FAILED=0
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# FlashInfer's JIT: one cache for every stage, one arch, every core, a toolkit with lib64/.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
    CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
    [ -d "$CUDA_HOME/lib64" ] || { [ -d /usr/local/cuda/lib64 ] && CUDA_HOME=/usr/local/cuda; }
fi
export CUDA_HOME="${CUDA_HOME:-}"
CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')"
[ "$CAP" = "9.0" ] && CAP="9.0a"
[ -n "$CAP" ] && export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$CAP}"
export FLASHINFER_WORKSPACE_BASE="$CACHE" TVM_FFI_CACHE_DIR="$CACHE/tvm-ffi"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

# record STAGE RC T0 LIMIT [STATUS]: append the stage's JSON line (data from its
# last "@@data {json}" line or from OUTDIR/<stage>.json's "targets").
record() {
    "$PY" - "$OUT/stages.jsonl" "$WORK/stage.log" "$OUT" "$@" <<'PYEOF'
import json, sys, time
from pathlib import Path
jsonl, log, out, stage, rc, t0, limit = sys.argv[1:8]
status = sys.argv[8] if len(sys.argv) > 8 else ""
rc, seconds = int(rc), time.time() - float(t0)
text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
if not status or rc != 0:  # a forced status (a skip) never hides a failure
    status = {0: "ok", 3: "skipped: no CUDA"}.get(rc, "timeout" if rc in (124, 137) else "failed")
data = None
for line in reversed(text.splitlines()):
    if line.startswith("@@data "):
        try:
            data = json.loads(line[len("@@data "):])
        except ValueError as e:
            data = {"unparsed": repr(e)}
        break
result = Path(out) / f"{stage}.json"
if data is None and result.exists():
    try:
        payload = json.loads(result.read_text())
        data = {k: payload[k] for k in ("targets", "status", "reason", "errors") if k in payload}
    except ValueError as e:
        data = {"unparsed": repr(e)}
junit = Path(out) / "pytest.xml"
if stage == "pytest" and junit.exists():
    import xml.etree.ElementTree as ET
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    data = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    data["failed"] = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ][:40]
line = {"stage": stage, "status": status, "rc": rc, "seconds": round(float(seconds), 1),
        "limit_s": int(limit), "data": data, "tail": text[-3000:]}
with open(jsonl, "a") as f:
    f.write(json.dumps(line, default=str) + "\n")
print(f"=== {stage}: {status} (rc {rc}, {float(seconds):.1f} s)")
PYEOF
}

# stage NAME LIMIT_S COMMAND...: run one stage under timeout, log it, record it.
stage() {
    local name="$1" limit="$2"
    shift 2
    : >"$WORK/stage.log"
    if [ -n "${GPU_CHECK_STAGES:-}" ] && [[ " $GPU_CHECK_STAGES " != *" $name "* ]]; then
        record "$name" 0 "$(date +%s.%N)" 0 "skipped: not in GPU_CHECK_STAGES" | tee -a "$OUT/check.log"
        STATUS=""
        return 0
    fi
    local left=$((BUDGET - ($(date +%s) - START) - 5))
    [ "$limit" -gt "$left" ] && limit="$left"
    if [ "$limit" -lt 10 ]; then
        record "$name" 0 "$(date +%s.%N)" 0 "skipped: budget spent" | tee -a "$OUT/check.log"
        STATUS=""
        return 0
    fi
    echo "=== $name (limit ${limit} s): $*" >>"$OUT/check.log"
    local t0 rc
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" >"$WORK/stage.log" 2>&1
    rc=$?
    cat "$WORK/stage.log" >>"$OUT/check.log"
    record "$name" "$rc" "$t0" "$limit" "${STATUS:-}" | tee -a "$OUT/check.log"
    STATUS=""
    case $rc in 0 | 3) ;; *) FAILED=1 ;; esac
    return "$rc"
}

: >"$OUT/stages.jsonl"
: >"$OUT/check.log"
stage probe 60 "$PY" benchmarks/gpu_stages.py probe
HAS_CUDA=0
grep -q '"cuda_available": true' "$OUT/stages.jsonl" && HAS_CUDA=1

CROSS=0
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || CROSS=1
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    STATUS="skipped: no wheels in $WHEELS (run benchmarks/gpu_wheels.sh)"
elif [ "$CROSS" = 1 ]; then
    STATUS="ok: unpacked for cp312, not importable by this Python"
fi
stage install 180 "$PY" benchmarks/gpu_stages.py install "$WHEELS" "$SITE" "$KERNELS"
# NOTE: also a site installed by an earlier call on the same machine (a rerun of some stages).
if [ "$CROSS" = 0 ] && [ -d "$SITE" ]; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi

stage jit 180 "$PY" benchmarks/gpu_stages.py jit
# NOTE: the families' attention modules (head dim 256, windows, soft caps) are built here,
# not in jit: a slow build of them cannot cost the base modules or the benchmarks' slices.
[ "$HAS_CUDA" = 0 ] && STATUS="ok: CPU rehearsal (stand-in flashinfer)"
stage attention 120 "$PY" benchmarks/gpu_stages.py attention

# NOTE: the benchmarks before the test run, each with its own slice: a slow or hanging test
# must not leave them "budget spent"; pytest takes what is left (about 2 minutes).
REHEARSAL=()
if [ "$HAS_CUDA" = 0 ]; then
    REHEARSAL=(--rehearsal)
    STATUS="ok: CPU rehearsal"
fi
stage gpu_decode 80 "$PY" benchmarks/gpu_decode.py "${REHEARSAL[@]}" --json "$OUT/gpu_decode.json"
[ "$HAS_CUDA" = 0 ] && STATUS="ok: CPU rehearsal"
stage gpu_e2e 100 "$PY" benchmarks/gpu_e2e.py "${REHEARSAL[@]}" --json "$OUT/gpu_e2e.json"

if [ "$HAS_CUDA" = 1 ]; then
    stage pytest 200 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
        --junitxml="$OUT/pytest.xml"
else
    mapfile -t TWINS < <("$PY" benchmarks/gpu_stages.py twins)
    # NOTE: 300 s on a CPU: the twins of every model family's device tests run here, off the device's time.
    STATUS="ok: CPU twins (no CUDA)" stage pytest 300 "$PY" -m pytest -q -p no:cacheprovider \
        --junitxml="$OUT/pytest.xml" "${TWINS[@]}"
fi


"$PY" - "$OUT/stages.jsonl" "$(($(date +%s) - START))" <<'PYEOF' | tee -a "$OUT/check.log"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
summary = {"stage": "summary", "seconds": int(sys.argv[2]),
           "statuses": {l["stage"]: l["status"] for l in lines}}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(summary) + "\n")
print(json.dumps(summary))
PYEOF
exit "$FAILED"
