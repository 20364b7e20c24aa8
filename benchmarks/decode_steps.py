"""Decode steps per second of the default model on this machine, at batch 1 and 32.

Drives the real scheduler and model runner on the calling thread (no frontend), greedy,
prompts of ~24 tokens, 64 new tokens each. Prints a table; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request
from inlinelm.sched.scheduler import Scheduler


def measure(runner: ModelRunner, batch: int, new_tokens: int) -> dict[str, float]:
    scheduler = Scheduler(runner.config, runner.num_kv_blocks, 2)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        scheduler.add_request(
            Request(f"r{batch}-{i}", [1 + (i * 7 + j) % 4000 for j in range(24)], params, 2)
        )
    decode_times: list[float] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        start = time.perf_counter()
        result = runner.execute(out)
        elapsed = time.perf_counter() - start
        if all(item.num_tokens == 1 for item in out.scheduled):
            decode_times.append(elapsed)
        scheduler.update_from_output(out, result)
    decode_times.sort()
    median = decode_times[len(decode_times) // 2]
    return {
        "batch": batch,
        "median_step_ms": median * 1e3,
        "steps_per_s": 1 / median,
        "tokens_per_s": batch / median,
    }


MODES = [
    ("float32", "none", "float32"),
    ("Q4_1 (auto)", "auto", "float32"),
    ("bfloat16", "none", "bfloat16"),
]
"""(label, quantization, dtype) of each runner."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    rows = []
    # NOTE: float32 weights, the default model's own blocks (quantization="auto") and the
    # model in bfloat16, one runner at a time, in the same run.
    for weights, mode, dtype in MODES:
        config = EngineConfig(
            max_num_batched_tokens=2048, num_kv_blocks=1024, quantization=mode, dtype=dtype
        )
        runner = ModelRunner(config, resolve_model("default", quantized=mode != "none").folder)
        runner.warmup()
        rows += [
            {"weights": weights, "quantization": mode, "dtype": dtype}
            | measure(runner, b, args.new_tokens)
            for b in (1, 32)
        ]
        runner.close()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'weights':>8} {'batch':>5} {'median step ms':>15} {'steps/s':>9} {'tokens/s':>9}")
    for r in rows:
        print(
            f"{r['weights']:>8} {r['batch']:>5} {r['median_step_ms']:>15.2f} "
            f"{r['steps_per_s']:>9.1f} {r['tokens_per_s']:>9.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
