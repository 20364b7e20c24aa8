"""First and second start of the default model: GGUF conversion, then cached load, with
block-quantized weights (``quantization="auto"``, the CPU default: the conversion that
keeps the file's blocks) and float32 (``"none"``).

Each start runs in a fresh process against an empty ``INLINELM_CACHE`` (first) and the
filled one (second), and times resolve + weights + tokenizer. ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, torch
t0 = time.perf_counter()
from transformers import AutoTokenizer
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.loading.weights import load_model
t1 = time.perf_counter()
quantization = sys.argv[1]
folder = resolve_model("default", quantized=quantization != "none").folder
t2 = time.perf_counter()
cfg = read_model_config(folder)
load_model(folder, cfg, dtype=torch.float32, device=torch.device("cpu"),
           backend=TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), max_positions=cfg.max_position_embeddings,
           quantization=quantization)
t3 = time.perf_counter()
AutoTokenizer.from_pretrained(str(folder))
t4 = time.perf_counter()
print(f"{t1-t0:.3f} {t2-t1:.3f} {t3-t2:.3f} {t4-t3:.3f}")
"""


def start(cache: str, quantization: str) -> list[float]:
    env = {**os.environ, "INLINELM_CACHE": cache}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, quantization],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = {}
    for quantization in ("auto", "none"):
        with tempfile.TemporaryDirectory() as cache:
            rows[f"first {quantization}"] = start(cache, quantization)
            rows[f"second {quantization}"] = start(cache, quantization)
    print(
        f"{'start':<12} {'imports s':>9} {'resolve s':>9} {'weights s':>9} {'tokenizer s':>11} {'load total s':>12}"
    )
    for name, (imp, res, w, tok) in rows.items():
        print(f"{name:<12} {imp:>9.2f} {res:>9.2f} {w:>9.2f} {tok:>11.2f} {res + w + tok:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "results": {
                        k: dict(
                            zip(
                                ("imports_s", "resolve_s", "weights_s", "tokenizer_s"),
                                v,
                                strict=True,
                            )
                        )
                        for k, v in rows.items()
                    }
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
