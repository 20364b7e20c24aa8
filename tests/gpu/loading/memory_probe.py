"""What loading a model costs in memory, measured in a process of its own (run as
``python -m tests.gpu.loading.memory_probe MODEL QUANTIZATION``; prints one JSON line).

The model is resolved first (a GGUF file converted, when its cache holds no conversion
yet: the first start), then its weights are loaded as the runner loads them (a second
start). Reported, in bytes: the weights' own tensors (each storage once: a tied quantized
head shares the embedding's), what ``weight_parts`` says they take (the memory check's
figure), the process's anonymous resident memory before and after loading (Linux's
RssAnon: the weights, not the file pages safetensors maps while reading), and the peak
resident set while loading (VmHWM after resetting it: anonymous and mapped file pages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, block-quantized weights), each
    storage counted once."""
    seen: dict[int, int] = {}
    tensors = [p.data for p in model.parameters()]
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        if blocks is not None:
            tensors.append(blocks.data)
        packed = getattr(module, "_packed", None)
        if packed is not None:
            tensors.append(packed)
    for t in tensors:
        if t.is_mkldnn:  # NOTE: oneDNN's packed layout has no storage to ask
            seen[id(t)] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def probe(model: str, quantization: str) -> dict[str, float]:
    from inlinelm.gpu.loading.model_files import resolve_model
    from inlinelm.gpu.model.cpu_extension import cpu_extension
    from inlinelm.gpu.model.registry import read_model_config
    from inlinelm.gpu.model_fit import planned_blocks
    from inlinelm.gpu.model_memory import return_free_heap, weight_parts
    from tests.gpu.reference import load_ours

    torch.set_num_threads(2)
    quantized = quantization != "none" and cpu_extension() is not None
    start = time.perf_counter()
    folder = resolve_model(model, quantized=quantized).folder
    resolve_s = time.perf_counter() - start
    cfg = read_model_config(folder)
    plan = planned_blocks(cfg, folder, quantization, torch.float32)
    return_free_heap()
    before = _status("RssAnon")
    Path("/proc/self/clear_refs").write_text("5")  # NOTE: resets VmHWM to the current RSS
    peak_base = _status("VmRSS")
    start = time.perf_counter()
    loaded = load_ours(folder, quantization)
    load_s = time.perf_counter() - start
    return_free_heap()
    after = _status("RssAnon")
    peak = _status("VmHWM") - peak_base
    return {
        "resolve_s": resolve_s,
        "load_s": load_s,
        "tensor_bytes": _tensor_bytes(loaded),
        "estimate_bytes": sum(weight_parts(cfg, torch.float32, plan)),
        "float32_bytes": sum(weight_parts(cfg, torch.float32)),
        "quantized_modules": len(plan),
        "anon_before": before,
        "anon_growth": after - before,
        "peak_growth": peak,
    }


ROOT = Path(__file__).resolve().parents[3]


def run_probe(model: Path | str, quantization: str, cache: Path) -> dict[str, float]:
    """:func:`probe` in a fresh process whose conversion cache is ``cache``."""
    env = {**os.environ, "INLINELM_CACHE": str(cache)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.gpu.loading.memory_probe", str(model), quantization],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"memory probe of {model} failed: {result.stderr[-3000:]}")
    values: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return values


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], sys.argv[2])))
