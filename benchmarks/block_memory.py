"""Quantized weights kept in their blocks from a GGUF file to the model (issue 24, items 1
and 4): memory and start times, each load in a fresh process
(``tests/gpu/loading/memory_probe.py``).

Rows:
- the default model (a Q4_1 file): its first start (converting the file) and its second
  (reading the conversion) with ``quantization="auto"`` (its blocks) and ``"none"``
  (float32),
  each from an empty cache, side by side in one run;
- a Qwen2.5-1.5B-shaped file (Q8_0) and a Qwen2.5-7B-shaped one (Q4_0), random blocks
  written with the ``gguf`` package, both kept in their own blocks: the weights' bytes
  against the file's, the process's anonymous memory after loading against them (issue
  24's bound: 1.15x) and its peak while loading; for
  the 7B shape also the memory check's answer for float32 weights.

Prints a table and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' GGUF writer

import gguf
from tests.gpu.loading.gguf_writer import write_random_gguf
from tests.gpu.loading.memory_probe import run_probe
from tests.gpu.loading.test_block_memory import BOUND, QWEN2_1_5B

from _common import load_average, write_json

QWEN2_7B = {
    **QWEN2_1_5B,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "num_hidden_layers": 28,
    "tie_word_embeddings": False,
}
SHAPED = {
    "Qwen2.5-1.5B-shaped Q8_0": ({**QWEN2_1_5B, "num_hidden_layers": 28}, "Q8_0"),
    "Qwen2.5-7B-shaped Q4_0": (QWEN2_7B, "Q4_0"),
}
MIB = 2**20


def default_model(root: Path) -> dict[str, Any]:
    """First and second start of the default model, quantized and float32, each from a
    cache of its own."""
    from inlinelm.gpu.loading.model_files import default_model_path

    path = default_model_path()
    rows: dict[str, Any] = {}
    for mode in ("auto", "none"):
        cache = root / f"default-{mode}"
        first = run_probe(path, mode, cache)
        second = run_probe(path, mode, cache)
        rows[mode] = {"first": first, "second": second}
        shutil.rmtree(cache)
    return rows


def float32_refusal(path: Path, cache: Path) -> str:
    """What the memory check says of the file's conversion with float32 weights."""
    import os

    from inlinelm.config import EngineConfig
    from inlinelm.errors import ModelLoadError
    from inlinelm.gpu.loading.model_files import resolve_model
    from inlinelm.gpu.model_fit import check_model_fits

    os.environ["INLINELM_CACHE"] = str(cache)
    folder = resolve_model(str(path), quantized=True).folder  # NOTE: its config is the same
    try:
        check_model_fits(EngineConfig(model=str(path), quantization="none"), folder)
    except ModelLoadError as e:
        return str(e)
    return "fits"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-7b", action="store_true", help="only the default model and 1.5B")
    args = parser.parse_args()
    from inlinelm.gpu.loading.model_files import resolve_model

    tokenizer = resolve_model("default").folder
    root = Path(tempfile.mkdtemp(prefix="block-memory-"))
    report: dict[str, Any] = {"load_average_before": load_average()}
    try:
        report["default"] = default_model(root)
        report["shaped"] = {}
        for name, (config, qtype) in SHAPED.items():
            if args.skip_7b and "7B" in name:
                continue
            path = root / f"{name.replace(' ', '-')}.gguf"
            size = write_random_gguf(path, config, gguf.GGMLQuantizationType[qtype], tokenizer)
            cache = root / f"cache-{qtype}"
            first = run_probe(path, "auto", cache)
            second = run_probe(path, "auto", cache)
            row = {"file_bytes": size, "first": first, "second": second}
            if "7B" in name:
                row["float32_check"] = float32_refusal(path, cache)
            report["shaped"][name] = row
            path.unlink()
            shutil.rmtree(cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["load_average_after"] = load_average()
    _print(report)
    write_json(args.json, report)


def _print(report: dict[str, Any]) -> None:
    print(f"load average {report['load_average_before']} -> {report['load_average_after']}")
    print("\n| default model | its blocks (auto) | float32 (none) |")
    print("|---|---|---|")
    q, f = report["default"]["auto"], report["default"]["none"]
    print(
        f"| first start: convert, s | {q['first']['resolve_s']:.1f} | {f['first']['resolve_s']:.1f} |"
    )
    print(
        f"| first start: load weights, s | {q['first']['load_s']:.2f} | {f['first']['load_s']:.2f} |"
    )
    print(
        f"| second start: load weights, s | {q['second']['load_s']:.2f} | {f['second']['load_s']:.2f} |"
    )
    print(
        f"| weights, MiB | {q['second']['tensor_bytes'] / MIB:.0f} | {f['second']['tensor_bytes'] / MIB:.0f} |"
    )
    print(
        f"| anonymous memory growth, MiB | {q['second']['anon_growth'] / MIB:.0f} | {f['second']['anon_growth'] / MIB:.0f} |"
    )
    print(
        f"\n| shaped file | file MiB | weights MiB | float32 would be MiB | convert s | load s (2nd) | anon growth / weights (bound {BOUND}) | peak growth / weights |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, row in report["shaped"].items():
        s = row["second"]
        w = s["tensor_bytes"]
        print(
            f"| {name} | {row['file_bytes'] / MIB:.0f} | {w / MIB:.0f} | {s['float32_bytes'] / MIB:.0f} "
            f"| {row['first']['resolve_s']:.0f} | {s['load_s']:.2f} | {s['anon_growth'] / w:.3f} "
            f"| {s['peak_growth'] / w:.3f} |"
        )
        if "float32_check" in row:
            print(f"\n{name} with float32 weights: {row['float32_check'][:300]}")


if __name__ == "__main__":
    main()
