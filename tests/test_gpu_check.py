"""The one-call GPU check rehearsed on a CPU: every stage reports, fast and softly.

``benchmarks/gpu_check.sh`` is what runs on the lent GPU machine; here it must report each
device stage as skipped ("no CUDA") within seconds, write one well-formed JSON line per
stage and exit 0, so a broken path, import or argument shows before device time is spent.
Without wheels in ``.whl/`` (``benchmarks/gpu_wheels.sh``) the install stage says so; with
them it unpacks them into a temporary folder (``--no-index``: no network either way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["probe", "install", "jit", "gpu_decode", "gpu_e2e", "pytest"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the check runs for real")
def test_the_gpu_check_fails_soft_and_fast_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_SITE": str(tmp_path / "site"),
        "GPU_CHECK_CACHE": str(tmp_path / "cache"),
    }
    start = time.perf_counter()
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    took = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert took < 120
    lines = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert [line["stage"] for line in lines] == [*STAGES, "summary"]
    for line in lines[:-1]:
        assert set(line) == {"stage", "status", "rc", "seconds", "limit_s", "data", "tail"}
        assert isinstance(line["seconds"], float) and line["seconds"] >= 0
        assert line["status"] == "ok" or line["status"].startswith(("ok: ", "skipped: ")), line
    status = {line["stage"]: line["status"] for line in lines[:-1]}
    assert lines[-1]["statuses"] == status
    assert status["probe"] == "ok"
    assert lines[0]["data"]["cuda_available"] is False
    for name in ("jit", "gpu_decode", "gpu_e2e"):
        assert status[name] == "skipped: no CUDA"
    assert status["pytest"] == "skipped: no CUDA (collected only)"
    assert " collected" in lines[STAGES.index("pytest")]["tail"]
    for name in ("gpu_decode", "gpu_e2e"):
        assert json.loads((out / f"{name}.json").read_text())["status"] == "skipped"
    assert (out / "check.log").read_text().count("=== ") >= 2 * len(STAGES)
