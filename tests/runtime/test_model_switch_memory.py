"""Switching models in one process leaks no model: engine A (a tiny random Llama) starts,
serves a request and is closed; then engine B (a tiny random Qwen2 of the same size) does
the same. A's memory comes back when it closes, and B's close leaves the process where A's
did: on the host (resident memory) and on a CUDA device (the allocator's count and the
driver's memory in use).

The models are small enough to load in a second, and big enough that a kept model shows:
49,152 × 256 tied embeddings and two layers are a 52 MiB float32 checkpoint (under the
64 MiB a real model starts at, ``tests/conftest.py``), which the runner holds as about
100 MiB (its LM head apart from the embedding). The host bound is half the checkpoint:
whatever keeps a model alive (a cache, a thread, a closure holding the runner or its
tensors) keeps at least the checkpoint's tensors resident, twice the bound, while in a
fresh process the C heap's arenas and caches move a reading by at most about 12 MiB
(measured over many runs and both orders of the models), half the bound. The switch runs in
a process of its own (as ``tests/gpu/loading/memory_probe.py`` does), so that what other
tests left in the test process (their threads, the allocator's arenas: up to 30 MiB either
way over the suite, ``tests/gpu/test_model_memory.py``) cannot move the readings. On a
device nothing else allocates: 8 MiB covers the CUDA libraries' per-thread state.

Nothing is timed and nothing sleeps: each reading comes after ``gc.collect()`` and the C
heap trimmed (``return_free_heap``), and on a device the allocator's cache emptied.
Run by hand: ``python -m tests.runtime.test_model_switch_memory cpu MODEL_A MODEL_B``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine
from inlinelm.gpu.model_memory import format_bytes, return_free_heap
from tests.conftest import make_tiny_model

MIB = 2**20
DEVICE_SLACK = 8 * MIB
ROOT = Path(__file__).resolve().parents[2]
SIZE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
POINTS = ("baseline", "running_a", "closed_a", "closed_b")

Figures = dict[str, int]
"""Named memory figures (bytes) read at one point."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, Path]:
    """Model A (Llama) and model B (Qwen2, the same sizes)."""
    root = tmp_path_factory.mktemp("switch")
    a = make_tiny_model(root / "a", tokenizer_dir, **SIZE)
    b = make_tiny_model(root / "b", tokenizer_dir, model_type="qwen2", **SIZE)
    return a, b


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's VmRSS")
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="needs glibc")
def test_switching_models_on_a_cpu_returns_each_models_memory(
    models: tuple[Path, Path],
) -> None:
    checkpoint = checkpoint_bytes(models[0])
    grown = growth(run_probe("cpu", *models), "resident")
    shown = {point: format_bytes(n) for point, n in grown.items()}
    # NOTE: the readings can see a model: A is resident while it serves.
    assert grown["running_a"] > checkpoint, shown
    assert grown["closed_a"] < checkpoint / 2, f"A kept memory after close(): {shown}"
    assert abs(grown["closed_b"] - grown["closed_a"]) < checkpoint / 2, (
        f"B's close left the process elsewhere than A's: {shown}"
    )


@pytest.mark.gpu
def test_switching_models_on_a_device_returns_each_models_memory(
    models: tuple[Path, Path],
) -> None:
    readings = run_probe("cuda", *models)
    for figure in ("allocated", "in_use"):
        grown = growth(readings, figure)
        shown = {point: format_bytes(n) for point, n in grown.items()}
        assert grown["running_a"] > checkpoint_bytes(models[0]) / 2, f"{figure}: {shown}"
        assert grown["closed_a"] <= DEVICE_SLACK, f"{figure}: A kept memory: {shown}"
        assert abs(grown["closed_b"] - grown["closed_a"]) <= DEVICE_SLACK, f"{figure}: {shown}"


def checkpoint_bytes(folder: Path) -> int:
    """The model's safetensors files' size: the least a kept copy of its weights holds."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def growth(readings: dict[str, Figures], figure: str) -> dict[str, int]:
    """How far ``figure`` is above its baseline at each point."""
    base = readings["baseline"][figure]
    return {point: readings[point][figure] - base for point in POINTS[1:]}


def run_probe(device: str, a: Path, b: Path) -> dict[str, Figures]:
    """:func:`probe` in a fresh process (a deadline only against a hang)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.test_model_switch_memory", device, str(a), str(b)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    readings: dict[str, Figures] = json.loads(done.stdout.strip().splitlines()[-1])
    return readings


def probe(device: str, a: Path, b: Path) -> dict[str, Figures]:
    """The figures of ``device`` at each of :data:`POINTS` while switching from A to B."""
    if device == "cpu":
        return switch(a, b, host_figures, num_threads=1, kv_cache_bytes=4 * MIB)
    return switch(a, b, device_figures, device=device, kv_cache_bytes=64 * MIB)


def switch(a: Path, b: Path, read: Callable[[], Figures], **options: Any) -> dict[str, Figures]:
    """``read()`` around serving A, then B. Before the baseline, a first engine on each has
    paid what a process pays once per model family (imports, kernels, tokenizer caches)."""
    serve_once(a, **options)
    serve_once(b, **options)
    readings = {"baseline": read()}
    readings["running_a"] = serve_once(a, read, **options)
    readings["closed_a"] = read()
    serve_once(b, **options)
    readings["closed_b"] = read()
    return readings


def serve_once(folder: Path, read: Callable[[], Figures] | None = None, **options: Any) -> Figures:
    """Start an engine on ``folder``, answer one request, close it; ``read()`` once it has
    answered (nothing without ``read``)."""
    engine = Engine(model=str(folder), max_num_seqs=2, **options)
    try:
        engine.start_sync()
        (out,) = engine.generate("Hello there", max_tokens=4, temperature=0.0, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        return read() if read is not None else {}
    finally:
        engine.close()


def host_figures() -> Figures:
    """The process's resident set (VmRSS), garbage collected and the C heap trimmed."""
    gc.collect()
    return_free_heap()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return {"resident": int(line.split()[1]) * 1024}
    raise AssertionError("no VmRSS in /proc/self/status")


def device_figures() -> Figures:
    """The bytes the allocator holds in tensors and the bytes the driver has in use on the
    current CUDA device, garbage collected and the allocator's cache emptied."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "in_use": total - free}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))))
