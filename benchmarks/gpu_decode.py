"""Decode step time of the model runner on a CUDA device, CUDA graphs on and off.

Two models with random bf16 weights made on the device (nothing is downloaded): the
SmolLM2-135M shape (the default model's config from ``benchmarks/gpu_assets``) and the
Llama-3-8B shape (hidden 4096, 32 layers, 32/8 heads, FFN 14336, vocab 128256). For each
model and each of ``enforce_eager=True`` / ``False`` the runner is built exactly as the
engine builds it (load, warm-up, graph capture), the real scheduler feeds it B requests of
32 prompt tokens, and once all B decode, every step ``runner.execute(batch)`` is timed with
CUDA events on the device and ``perf_counter`` on the host (a step ends with the sampled
tokens on the host, so the two agree; the table quotes the host time). The 8B step is
compared with its weight-bandwidth floor: the bytes one step must read (every weight but
the embedding table, plus the KV cache) over the device copy bandwidth measured in this run.

Exits 3 with a 'skipped' record when there is no CUDA device, unless ``--rehearsal``: then
it runs on the CPU at tiny shapes (both models shrunk, batches 1 and 2, float32), the static
decode step uncaptured (see ``_gpu.runner_as_on_cuda``). Prints a table; ``--json PATH``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _gpu
from _common import median, percentile, write_json

BATCHES = (1, 8, 32, 64, 128, 256)
REHEARSAL_BATCHES = (1, 2)
REHEARSAL_STEPS = (1, 3)  # warm-up and timed decode steps of a CPU rehearsal
REHEARSAL_MAX_MODEL_LEN = 128
PROMPT_TOKENS = 32
WARMUP_STEPS = 3
TIMED_STEPS = 20
TARGETS = {
    "smollm2_graph_bs1_ms": 1.0,
    "smollm2_eager_over_graph_bs1": 3.0,
    "llama8b_graph_bs1_over_floor": 1.10,
}


def model_shapes(device: str = "cuda") -> dict[str, dict[str, Any]]:
    """The two measured shapes; on a CPU rehearsal, tiny ones of the same kinds (query heads
    per KV head 2 and 4, tied and untied heads)."""
    shapes = {"smollm2-135m": _gpu.smollm2_config(), "llama3-8b": dict(_gpu.LLAMA3_8B)}
    if device != "cuda":
        return {
            name: _gpu.tiny_shape(c, 2 if name == "smollm2-135m" else 1)
            for name, c in shapes.items()
        }
    return shapes


def runner_options(
    graphs: bool, attention_backend: str, max_batch: int, device: str = "cuda"
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "device": device,
        "dtype": _gpu.model_dtype(device),
        "attention_backend": attention_backend,
        "enforce_eager": not graphs,
        "async_scheduling": False,
        "max_num_seqs": max_batch,
        "max_num_batched_tokens": max(2048, max_batch * PROMPT_TOKENS),
        "max_model_len": 1024 if device == "cuda" else REHEARSAL_MAX_MODEL_LEN,
        # every request: 32 prompt + 24 new tokens = 4 blocks of 16
        "num_kv_blocks": max_batch * 4 + 64,
    }
    if graphs:
        options["max_cuda_graph_batch_size"] = max_batch
    return options


def decode_steps(runner: Any, scheduler: Any, batch: int, device: str) -> dict[str, Any]:
    """Time ``TIMED_STEPS`` decode steps of ``batch`` requests (after prefill and a warm-up;
    fewer of both on a CPU rehearsal).

    One scheduler serves every batch of a runner, as in the engine: the rows of finished
    requests leave the runner's persistent batch with the next step.
    """
    from inlinelm.sampling_params import SamplingParams
    from inlinelm.sched.request import Request

    warmup, timed = (WARMUP_STEPS, TIMED_STEPS) if device == "cuda" else REHEARSAL_STEPS
    params = SamplingParams(temperature=0.0, max_tokens=warmup + timed + 1, ignore_eos=True)
    vocab = runner.model_config.vocab_size
    for i in range(batch):
        ids = [1 + (i * 131 + j * 7) % (vocab - 1) for j in range(PROMPT_TOKENS)]
        scheduler.add_request(Request(f"b{batch}-{i}", ids, params, None))
    host_ms: list[float] = []
    device_ms: list[float] = []
    decode_seen = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        decoding = len(out.scheduled) == batch and all(s.num_tokens == 1 for s in out.scheduled)
        start, end = _gpu.event(device), _gpu.event(device)
        start.record()
        t0 = time.perf_counter()
        result = runner.execute(out)
        t1 = time.perf_counter()
        end.record()
        scheduler.update_from_output(out, result)
        decode_seen += decoding
        if decoding and decode_seen > warmup and len(host_ms) < timed:
            end.synchronize()
            host_ms.append((t1 - t0) * 1e3)
            device_ms.append(start.elapsed_time(end))
    if not host_ms:
        raise RuntimeError(f"no decode step of {batch} requests was seen")
    return {
        "batch": batch,
        "step_ms": median(host_ms),
        "step_ms_p90": percentile(host_ms, 90),
        "event_ms": median(device_ms),
        "tokens_per_s": batch / median(host_ms) * 1e3,
        "steps": len(host_ms),
    }


def floor_ms(runner: Any, batch: int, bandwidth: float) -> float:
    """Bytes one decode step must read (weights but the embedding table, KV) / bandwidth."""
    model = runner.model
    embed = model.embed_tokens.weight
    weight_bytes = sum(
        t.numel() * t.element_size() for t in model.parameters() if t.data_ptr() != embed.data_ptr()
    )
    # NOTE: a tied head is a copy of the embedding (lm_head.weight_t), counted above.
    cfg = runner.model_config
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * embed.element_size()
    context = PROMPT_TOKENS + WARMUP_STEPS + TIMED_STEPS // 2
    return float((weight_bytes + batch * context * kv_per_token) / bandwidth * 1e3)


def measure_model(
    name: str, shape: dict[str, Any], args: argparse.Namespace, bandwidth: float
) -> list[dict[str, Any]]:
    from inlinelm.sched.scheduler import Scheduler

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _gpu.write_config_folder(Path(tmp) / name, shape)
        for graphs in (True, False):
            mode = "graph" if graphs else "eager"
            try:
                config = _gpu.engine_config(
                    **runner_options(graphs, args.attention_backend, max(args.batches), args.device)
                )
                t0 = time.perf_counter()
                with _gpu.random_weights():
                    runner = _gpu.build_runner(config, folder)
                build_s = time.perf_counter() - t0
            except Exception as e:
                rows.append({"model": name, "mode": mode, "error": _gpu.error_text(e)})
                print(f"{name} {mode}: {rows[-1]['error']}", flush=True)
                continue
            print(f"{name} {mode}: runner built in {build_s:.1f} s", flush=True)
            scheduler = Scheduler(runner.config, runner.num_kv_blocks, None)
            for batch in args.batches:
                row: dict[str, Any] = {"model": name, "mode": mode, "build_s": build_s}
                try:
                    row.update(decode_steps(runner, scheduler, batch, args.device))
                    row["floor_ms"] = floor_ms(runner, batch, bandwidth)
                except Exception as e:
                    row.update(batch=batch, error=_gpu.error_text(e))
                rows.append(row)
                print(f"  {name} {mode} B={batch}: {row.get('step_ms', row.get('error'))}")
            runner.close()
            del runner
            gc.collect()
            _gpu.empty_cache(args.device)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def step(model: str, mode: str, batch: int) -> float | None:
        for r in rows:
            if (r["model"], r["mode"], r.get("batch")) == (model, mode, batch) and "step_ms" in r:
                return float(r["step_ms"])
        return None

    def floor(model: str) -> float | None:
        for r in rows:
            if r["model"] == model and r.get("batch") == 1 and "floor_ms" in r:
                return float(r["floor_ms"])
        return None

    small_graph, small_eager = step("smollm2-135m", "graph", 1), step("smollm2-135m", "eager", 1)
    big_graph, big_floor = step("llama3-8b", "graph", 1), floor("llama3-8b")
    measured = {
        "smollm2_graph_bs1_ms": small_graph,
        "smollm2_eager_over_graph_bs1": small_eager / small_graph
        if small_graph and small_eager
        else None,
        "llama8b_graph_bs1_over_floor": big_graph / big_floor if big_graph and big_floor else None,
    }
    met = {
        "smollm2_graph_bs1_ms": lambda v: v <= TARGETS["smollm2_graph_bs1_ms"],
        "smollm2_eager_over_graph_bs1": lambda v: v >= TARGETS["smollm2_eager_over_graph_bs1"],
        "llama8b_graph_bs1_over_floor": lambda v: v <= TARGETS["llama8b_graph_bs1_over_floor"],
    }
    return {
        key: {
            "measured": value,
            "target": TARGETS[key],
            "met": None if value is None else bool(met[key](value)),
        }
        for key, value in measured.items()
    }


def print_table(rows: list[dict[str, Any]], bandwidth: float, verdict: dict[str, Any]) -> None:
    print(f"\ndevice copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    print(
        f"{'model':>13} {'batch':>5} {'graph ms':>9} {'eager ms':>9} {'eager/graph':>11} "
        f"{'floor ms':>9} {'graph/floor':>11} {'graph tok/s':>11}"
    )
    keys = sorted({(r["model"], r["batch"]) for r in rows if "batch" in r})
    by_key = {(r["model"], r["mode"], r.get("batch")): r for r in rows}
    for model, batch in keys:
        g = by_key.get((model, "graph", batch), {})
        e = by_key.get((model, "eager", batch), {})
        gs, es, fl = g.get("step_ms"), e.get("step_ms"), g.get("floor_ms", e.get("floor_ms"))

        def f(v: float | None, spec: str = "9.3f") -> str:
            return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

        print(
            f"{model:>13} {batch:>5} {f(gs)} {f(es)} {f(es / gs if gs and es else None, '11.2f')} "
            f"{f(fl)} {f(gs / fl if gs and fl else None, '11.2f')} "
            f"{f(g.get('tokens_per_s'), '11.0f')}"
        )
    for r in rows:
        if "error" in r:
            print(f"error: {r['model']} {r['mode']} B={r.get('batch', '-')}: {r['error']}")
    print("\ntargets (H200):")
    for key, v in verdict.items():
        value = "n/a" if v["measured"] is None else f"{v['measured']:.3f}"
        print(f"  {key:<32} measured {value:>8}  target {v['target']}  met: {v['met']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--models", nargs="+", default=list(model_shapes()))
    parser.add_argument("--attention-backend", default="auto")
    _gpu.add_rehearsal_argument(parser)
    args = parser.parse_args()
    args.device = _gpu.pick_device(args.rehearsal, args.json, "gpu_decode")
    if args.batches is None:
        args.batches = list(BATCHES if args.device == "cuda" else REHEARSAL_BATCHES)
    import torch

    bandwidth = _gpu.copy_bandwidth(args.device)
    rows: list[dict[str, Any]] = []
    with _gpu.runner_as_on_cuda(args.device):
        for name in args.models:
            rows.extend(measure_model(name, model_shapes(args.device)[name], args, bandwidth))
    verdict = verdicts(rows)
    print_table(rows, bandwidth, verdict)
    write_json(
        args.json,
        {
            "device": _gpu.device_name(args.device),
            "rehearsal": args.device != "cuda",
            "torch": torch.__version__,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "rows": rows,
            "targets": verdict,
        },
    )
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
