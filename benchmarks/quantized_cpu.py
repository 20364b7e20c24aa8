"""Block-quantized weights on this CPU: the default model with ``quantization="auto"`` (its
Q4_1 GGUF file's own blocks, the embedding and tied head Q8_0) against ``"none"`` (float32
weights), side by side in one run.

(a) the linear layers of one decode step (every matmul shape of the default model, timed
    alone, summed over a step's 121 calls) at 1, 32 and 256 rows: oneDNN's packed float32
    (the float path), our block kernel with the model's kinds (as the engine runs it, and
    its integer loops alone) and with Q8_0 throughout,
    and for reference torch's fbgemm int8 linear (per-channel int8 weights, the input on
    one scale per call);
(b) one request, 64 new tokens: ms per token, the two engines alternately, three times each
    (each engine in a process of its own);
(c) 32 requests with mixed prompts, 64 new tokens each, all at once: tokens/s, TTFT p50;
(d) the process's resident memory after each engine loaded (each in a fresh child process,
    so neither holds the other's pages).

Prints a table and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _common import load_average, median, percentile, workers, write_json
from e2e_cpu import make_prompts

SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]
"""(out, in, calls per step) of the default model's linear layers: QKV, O, gate/up, down
per layer (30 layers), and the tied LM head."""
MODES = ("none", "auto")


OURS = "ours, the model's kinds"
INTEGER = "ours, the model's kinds, integer loops"
KERNELS = ["float32 oneDNN", OURS, INTEGER, "ours, Q8_0", "fbgemm int8"]
"""``OURS`` is what the engine runs (``"fastest"``: where the CPU has AMX, bfloat16 products
from 64 rows and the integer loops on AMX's int8 tiles from 16); ``INTEGER`` forces the
fastest integer loops without AMX (VNNI) at every row count."""


def _blocks(weight: torch.Tensor, kind: str) -> Any:
    import gguf

    from inlinelm.gpu.model.layers.blocks import BlockWeight

    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[kind])
    blocks = BlockWeight.empty(kind, *weight.shape, torch.device("cpu"))
    blocks.pack(0, torch.from_numpy(raw.copy()))
    return blocks


def _kernel(name: str, weight: torch.Tensor, x: torch.Tensor) -> Any:
    if name == "float32 oneDNN":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if name.startswith("ours"):
        # NOTE: the model's kinds: Q4_1 layers, the tied LM head (the vocabulary's rows) Q8_0
        q4 = name in (OURS, INTEGER) and weight.shape[0] != SHAPES[-1][0]
        blocks = _blocks(weight, "Q4_1" if q4 else "Q8_0")
        loops = "integer" if name == INTEGER else "fastest"
        return lambda: blocks.matmul(x, None, loops)
    scale = weight.abs().amax(dim=1) / 127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero = torch.zeros(weight.shape[0], dtype=torch.int64)
        qw = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda: torch.ops.quantized.linear_dynamic(x, packed)


def kernels(rows: list[int], repeats: int = 7) -> dict[str, dict[str, float]]:
    """(a): ms per step of each kernel at each row count, medians of interleaved runs."""
    names = KERNELS
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for m in rows:
            calls = {
                name: [
                    (_kernel(name, torch.randn(o, i) * 0.02, torch.randn(m, i)), c)
                    for o, i, c in SHAPES
                ]
                for name in names
            }
            times: dict[str, list[float]] = {name: [] for name in names}
            for name in names:
                for fn, _ in calls[name]:
                    fn()
            for _ in range(repeats):
                for name in names:
                    n = 10 if m < 100 else 3
                    total = 0.0
                    for fn, count in calls[name]:
                        start = time.perf_counter()
                        for _ in range(n):
                            fn()
                        total += (time.perf_counter() - start) / n * count
                    times[name].append(total * 1e3)
            out[str(m)] = {name: median(v) for name, v in times.items()}
    return out


async def _one(engine: Any, prompt: list[int], new: int) -> tuple[float, float | None]:
    """One request's wall time and TTFT."""
    from inlinelm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start, ttft = time.perf_counter(), None
    async for out in engine.stream(prompt, params):
        ttft = out.metrics.ttft if ttft is None else ttft
    return time.perf_counter() - start, ttft


def _engine_child(mode: str, threads: int, conn: Any) -> None:
    """One mode's engine in a process of its own, answering jobs from :func:`engines`:
    ``("single", prompt, new)`` with its ms per token, ``("batch", prompts, new)`` with
    tokens/s and TTFT p50; None ends it."""
    from inlinelm import Engine

    async def serve() -> None:
        # NOTE: a fixed count: the default rule counts the other engine's process as load
        engine = Engine(quantization=mode, num_threads=threads)
        await engine.start()
        conn.send(None)
        # NOTE: the loop waits on the pipe only while no request is in flight
        while (job := conn.recv()) is not None:
            kind, prompts, new = job
            if kind == "single":
                wall, ttft = await _one(engine, prompts, new)
                conn.send((wall - (ttft or 0)) / (new - 1) * 1e3)
                continue
            start = time.perf_counter()
            runs = await asyncio.gather(*(_one(engine, p, new) for p in prompts))
            wall = time.perf_counter() - start
            ttfts = [t for _, t in runs if t is not None]
            conn.send((len(prompts) * new / wall, percentile(ttfts, 50)))
        await engine.aclose()

    asyncio.run(serve())


def engines(prompts: list[list[int]], single: list[int], new: int) -> dict[str, Any]:
    """(b) and (c) for both modes, each engine in a process of its own (two engines in
    one process run two OpenMP teams, which slows both: see ``_common.workers``)."""
    threads = torch.get_num_threads()
    targets = {mode: (_engine_child, (mode, threads)) for mode in MODES}
    result: dict[str, Any] = {}
    with workers(targets) as conns:
        for conn in conns.values():
            conn.recv()  # started
        for conn in conns.values():  # warm-up
            conn.send(("batch", prompts[:4], new))
            conn.recv()
        singles: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(3):
            for mode, conn in conns.items():
                conn.send(("single", single, new))
                singles[mode].append(conn.recv())
        for mode, conn in conns.items():
            conn.send(("batch", prompts, new))
            tokens_per_s, ttft = conn.recv()
            result[mode] = {
                "single": median(singles[mode]),
                "batch_tokens_per_s": tokens_per_s,
                "batch_ttft_p50_s": ttft,
            }
    return result


def _rss_child(mode: str, conn: Any) -> None:
    from inlinelm import Engine

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    engine = Engine(quantization=mode)
    engine.generate("hello", max_tokens=2, use_tqdm=False)
    conn.send((before, rss()))
    engine.close()


def resident(mode: str) -> tuple[int, int]:
    """(d): the RSS of a fresh process before and after an engine of ``mode`` started."""
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_rss_child, args=(mode, child))
    proc.start()
    before, after = parent.recv()
    proc.join()
    return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from inlinelm.gpu.loading.model_files import resolve_model

    folder = resolve_model("default").folder
    prompts = make_prompts(AutoTokenizer.from_pretrained(str(folder)), args.requests, 500)
    print(
        f"quantized_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {load_average()}",
        flush=True,
    )
    report: dict[str, Any] = {"kernels_ms_per_step": kernels([1, 32, 256])}
    report["engines"] = engines(prompts, prompts[1], args.new_tokens)
    report["rss_mib"] = {mode: [round(v / 2**20, 1) for v in resident(mode)] for mode in MODES}
    report["load_average"] = load_average()
    print("\n(a) linear layers of one step, ms (medians of interleaved runs)")
    names = list(next(iter(report["kernels_ms_per_step"].values())))
    print("| rows | " + " | ".join(names) + " | float32 / ours |")
    print("|---" * (len(names) + 2) + "|")
    for rows, row in report["kernels_ms_per_step"].items():
        ratio = row["float32 oneDNN"] / row[OURS]
        print(f"| {rows} | " + " | ".join(f"{row[n]:.1f}" for n in names) + f" | {ratio:.2f} |")
    e = report["engines"]
    print("\n(b)-(d) the default model, float32 weights against its blocks")
    print("| | float32 (`none`) | Q4_1 blocks (`auto`) | ratio |")
    print("|---|---|---|---|")
    for key, label, better_low in (
        ("single", "one request: ms per token", True),
        ("batch_tokens_per_s", f"{args.requests} requests: tokens/s", False),
        ("batch_ttft_p50_s", f"{args.requests} requests: TTFT p50 s", True),
    ):
        a, b = e["none"][key], e["auto"][key]
        print(f"| {label} | {a:.2f} | {b:.2f} | {a / b if better_low else b / a:.2f}x |")
    (b0, b1), (q0, q1) = report["rss_mib"]["none"], report["rss_mib"]["auto"]
    print(f"| RSS before / after start, MiB | {b0} / {b1} | {q0} / {q1} | |")
    print(f"load average {report['load_average']}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
