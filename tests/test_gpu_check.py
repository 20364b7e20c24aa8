"""The one-call GPU check rehearsed on a CPU: the device stages run the same code at tiny
shapes and every row they write holds numbers.

``benchmarks/gpu_check.sh`` is what runs on the lent GPU machine. Without CUDA it runs
gpu_decode and gpu_e2e with ``--rehearsal`` (the CPU, the uncaptured static decode step,
the pipelined engine loop, the HTTP clients of the idle measurement), so a broken path,
import, argument or unpacking shows here before device time is spent. The pytest stage's
CPU twins are checked to exist (running them takes over a minute on 2 cores, so only
collected here); the wheels and the prebuilt kernels are left out (an empty folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
STAGES = ["probe", "install", "jit", "attention", "gpu_decode", "gpu_e2e", "pytest"]
REHEARSED = ["probe", "install", "jit", "attention", "gpu_decode", "gpu_e2e"]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a CUDA machine the check runs for real"
)


@pytest.fixture
def benchmarks_on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


def _numbers(row: dict[str, Any], keys: tuple[str, ...]) -> None:
    assert "error" not in row, row
    for key in keys:
        assert isinstance(row[key], int | float), (key, row)


def test_the_rehearsal_runs_both_benchmarks_without_an_error_row(tmp_path: Path) -> None:
    out, empty = tmp_path / "out", tmp_path / "empty"
    empty.mkdir()
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_STAGES": " ".join(REHEARSED),
        "GPU_CHECK_WHEELS": str(empty),
        "GPU_CHECK_KERNELS": str(empty),
        "GPU_CHECK_SITE": str(tmp_path / "site"),
        "GPU_CHECK_CACHE": str(tmp_path / "cache"),
    }
    start = time.perf_counter()
    done = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_check.sh"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    took = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert [line["stage"] for line in lines] == [*STAGES, "summary"]
    for line in lines[:-1]:
        assert set(line) == {"stage", "status", "rc", "seconds", "limit_s", "data", "tail"}
        assert isinstance(line["seconds"], float) and line["seconds"] >= 0
    status = {line["stage"]: line["status"] for line in lines[:-1]}
    assert lines[-1]["statuses"] == status
    assert status == {
        "probe": "ok",
        "install": f"skipped: no wheels in {empty} (run benchmarks/gpu_wheels.sh)",
        "jit": "skipped: no CUDA",
        "attention": "ok: CPU rehearsal (stand-in flashinfer)",
        "gpu_decode": "ok: CPU rehearsal",
        "gpu_e2e": "ok: CPU rehearsal",
        "pytest": "skipped: not in GPU_CHECK_STAGES",
    }
    probe, install = lines[0]["data"], lines[1]["data"]
    assert probe["cuda_available"] is False
    assert "cuda_home_missing" in probe and "packages" not in probe  # packages: after install
    assert "torch" not in install["packages"] and "flashinfer" in install["packages"]
    attention = lines[STAGES.index("attention")]["data"]
    assert {row["shape"] for row in attention["shapes"]} == {"gemma2", "gemma3"}
    for row in attention["shapes"]:
        assert "error" not in row, row
        assert set(row["max_abs_error"]) == {"prefill", "decode", "graph_decode"}
        assert all(0 <= e < 1e-4 for e in row["max_abs_error"].values()), row

    decode = json.loads((out / "gpu_decode.json").read_text())
    assert decode["rehearsal"] is True and decode["copy_bandwidth_bytes_per_s"] > 0
    assert {(r["model"], r["mode"], r["batch"]) for r in decode["rows"]} == {
        (m, mode, b)
        for m in ("smollm2-135m", "llama3-8b")
        for mode in ("graph", "eager")
        for b in (1, 2)
    }
    for row in decode["rows"]:
        _numbers(row, ("build_s", "step_ms", "step_ms_p90", "event_ms", "tokens_per_s", "floor_ms"))
    assert all(v["measured"] is not None for v in decode["targets"].values())

    e2e = json.loads((out / "gpu_e2e.json").read_text())
    assert e2e["rehearsal"] is True and e2e["errors"] == []
    assert {(r["system"], r["concurrency"]) for r in e2e["rows"]} == {
        (s, c) for s in ("inlinelm", "transformers generate") for c in (1, 2, 4)
    }
    for row in e2e["rows"]:
        _numbers(row, ("tokens_per_s", "wall_s", "ttft_ms_p50", "itl_ms_p50"))
    idle = e2e["idle"]
    assert idle["engine_loop"] == "pipelined"
    for name in ("in_process_256", "http_256"):
        _numbers(idle[name], ("full_batch_step_pairs", "device_step_period_ms_p50", "idle_share"))
        assert idle[name]["full_batch_step_pairs"] > 0
    assert idle["http_256"]["complete_streams"] == 4
    assert all(v["measured"] is not None for v in e2e["targets"].values())
    assert took < 120  # 44 s on a 2-core machine at load 5


def test_every_gpu_test_named_has_cpu_twins_that_run_without_cuda(
    benchmarks_on_path: None,
) -> None:
    import gpu_stages

    twins = sorted({t for pair in gpu_stages.CPU_TWINS.values() for t in pair})
    # NOTE: "not gpu" deselects a gpu-marked twin, which then counts as missing.
    pytest = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run(
        [*pytest, "-m", "not gpu", *twins],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    nodes = {line.split("[")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert set(twins) <= nodes, set(twins) - nodes
    for gpu_test in gpu_stages.CPU_TWINS:
        path, name = gpu_test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), gpu_test


def test_build_runner_returns_the_runner_of_the_four_values(
    benchmarks_on_path: None, tmp_path: Path
) -> None:
    """D3 of the GPU review: ``_build_runner`` returns four values, the benchmarks take one."""
    import _gpu
    from inlinelm.gpu.model_runner import ModelRunner

    shape = _gpu.tiny_shape(_gpu.smollm2_config(), 2)
    folder = _gpu.write_config_folder(tmp_path / "tiny", shape)
    config = _gpu.engine_config(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    with _gpu.random_weights():
        runner = _gpu.build_runner(config, folder)
    try:
        assert isinstance(runner, ModelRunner) and runner.model_config.num_layers == 2
    finally:
        runner.close()


def test_the_checks_family_shapes_are_the_gpu_tests(benchmarks_on_path: None) -> None:
    """The modules gpu_kernels builds ahead are the ones the gpu tests' family shapes
    select: the two name the same heads and layer kinds."""
    import gpu_kernels
    from inlinelm.gpu.attention.metadata import LayerAttention
    from tests.gpu.attention.test_attention_backends import CUDA_FAMILY_SHAPES

    ours = {
        name: (heads, kv_heads, head_dim, [LayerAttention(*kind) for kind in kinds])
        for name, (heads, kv_heads, head_dim, kinds) in gpu_kernels.FAMILY_SHAPES.items()
    }
    assert ours == CUDA_FAMILY_SHAPES
