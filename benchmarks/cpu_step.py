"""A CPU decode step's ops besides its matmuls: inlinelm's fused float32 kernels
(``gpu/model/csrc/cpu_ops.cpp``: RMSNorm, the residual add, RoPE, the gated activation, the
KV write and paged decode attention) against torch's ops, side by side in one run.

The default model, float32 and quantized weights (``quantization="none"`` and ``"auto"``: its
Q4_1 blocks), each loaded twice: once as the engine runs it (the extension's kernels),
once with the extension's float32 kernels withheld (torch's ops; quantized layers keep
their kernel). The real
scheduler and model runner on the calling thread, greedy, prompts of ~24 tokens, batches
of 1 and 32, the four runners taking turns for ``--rounds`` rounds. Each decode step is
timed whole, and its linear layers inside it (a clock around every ``Linear.forward``, and
around each block matmul of the decoder stack that runs a quantized model's decode steps
in one extension call: the weights come from memory as they do in a step, which a matmul
timed alone in a loop does not show); "rest" = step - matmuls, everything else the step
does (the kernels compared here, the layers' Python, the inputs, sampling). Medians over
the steps. With torch's ops the model has no decoder stack (it runs the extension's
kernels only), so that column also shows the layers' Python.

Prints a table and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _common import load_average, median, write_json
from inlinelm.config import EngineConfig
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.model.layers.linear import Linear
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request
from inlinelm.sched.scheduler import Scheduler

WEIGHTS = {"none": "float32", "auto": "Q4_1"}
BATCHES = (1, 32)


def runner(quantization: str, fused: bool) -> ModelRunner:
    config = EngineConfig(
        max_num_batched_tokens=2048, num_kv_blocks=1024, quantization=quantization
    )
    folder = resolve_model("default", quantized=quantization != "none").folder
    if fused:
        made = ModelRunner(config, folder)
        assert made.cpu_ops is not None, "the CPU extension did not build"
    else:
        with mock.patch("inlinelm.gpu.model_runner.cpu_ops", lambda device, dtype: None):
            made = ModelRunner(config, folder)
    made.warmup()
    return made


class MatmulClock:
    """Seconds spent in ``Linear.forward`` since the last :meth:`take`, and in the block
    matmuls of a decoder stack (``inlinelm.gpu.model.decoder_stack``, which runs a decode
    step's layers without their Python) when a runner has one."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._forward = Linear.forward
        self.stacks: list[Any] = []

    def watch(self, made: ModelRunner) -> None:
        """Clock the matmuls of ``made``'s decoder stack, if it has one."""
        stack = made.model.decoder_stack
        if stack is not None:
            stack.clock_matmuls(True)
            self.stacks.append(stack)

    def timed(self) -> Any:
        """A ``Linear.forward`` that adds its time to :attr:`spent`."""

        def forward(layer: Linear, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out: torch.Tensor = self._forward(layer, x)
            self.spent += time.perf_counter() - start
            return out

        return forward

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent + sum(stack.take_matmul_seconds() for stack in self.stacks)


def measure(
    made: ModelRunner, clock: MatmulClock, batch: int, new: int
) -> list[tuple[float, float]]:
    """(step, matmuls) seconds of every decode step of ``batch`` requests."""
    scheduler = Scheduler(made.config, made.num_kv_blocks, 2)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i in range(batch):
        prompt = [1 + (i * 7 + j) % 4000 for j in range(24)]
        scheduler.add_request(Request(f"r{batch}-{i}", prompt, params, 2))
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        clock.take()
        start = time.perf_counter()
        result = made.execute(out)
        elapsed = time.perf_counter() - start
        if all(item.num_tokens == 1 for item in out.scheduled):
            steps.append((elapsed, clock.take()))
        scheduler.update_from_output(out, result)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"cpu_step: torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {load_average()}",
        flush=True,
    )
    runners = {(q, fused): runner(q, fused) for q in WEIGHTS for fused in (False, True)}
    clock = MatmulClock()
    for made in runners.values():
        clock.watch(made)
    steps: dict[tuple[str, bool, int], list[tuple[float, float]]] = {}
    with mock.patch.object(Linear, "forward", clock.timed()):
        for _ in range(args.rounds):
            for (q, fused), made in runners.items():
                for batch in BATCHES:
                    got = measure(made, clock, batch, args.new_tokens)
                    steps.setdefault((q, fused, batch), []).extend(got)
    for made in runners.values():
        made.close()
    rows: list[dict[str, Any]] = []
    for q in WEIGHTS:
        for batch in BATCHES:
            row: dict[str, Any] = {"weights": WEIGHTS[q], "batch": batch}
            for name, fused in (("torch_ops", False), ("fused", True)):
                timed = steps[(q, fused, batch)]
                row[f"{name}_step_ms"] = median([s for s, _ in timed]) * 1e3
                row[f"{name}_matmuls_ms"] = median([m for _, m in timed]) * 1e3
                row[f"{name}_rest_ms"] = median([s - m for s, m in timed]) * 1e3
            row["step_speedup"] = row["torch_ops_step_ms"] / row["fused_step_ms"]
            row["rest_speedup"] = row["torch_ops_rest_ms"] / row["fused_rest_ms"]
            rows.append(row)
    print("\nmedian decode step, ms: step = matmuls + rest")
    print(
        "| weights | batch | torch ops: step = matmuls + rest | fused: step = matmuls + rest "
        "| step speed-up | rest speed-up |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            f"{r[f'{n}_step_ms']:.1f} = {r[f'{n}_matmuls_ms']:.1f} + {r[f'{n}_rest_ms']:.2f}"
            for n in ("torch_ops", "fused")
        ]
        print(
            f"| {r['weights']} | {r['batch']} | {cells[0]} | {cells[1]} | "
            f"{r['step_speedup']:.2f}x | {r['rest_speedup']:.2f}x |"
        )
    print(f"load average {load_average()}")
    write_json(args.json, {"results": rows, "load_average": load_average()})


if __name__ == "__main__":
    main()
