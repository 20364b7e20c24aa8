"""The whole engine on a CUDA device against transformers ``generate`` on the same device.

A SmolLM2-135M-shaped model with random bf16 weights (the default model's config and real
tokenizer from ``benchmarks/gpu_assets``) is written to a temporary folder and loaded by both.
Chat prompts of mixed length, 128 new tokens each (``ignore_eos``), greedy:

* inlinelm ``Engine.stream`` at 1, 64 and 256 concurrent requests (the engine's defaults:
  pipelined loop, CUDA graphs): tokens/s, TTFT and inter-token latency p50/p99 as the
  caller's coroutine sees them;
* transformers ``generate`` on the same prompts as one static batch (left padding):
  tokens/s, and its TTFT as the time of ``generate(max_new_tokens=1)`` on that batch;
* the device's idle share between engine steps while 256 requests decode, once with the
  consumers in this process (no HTTP) and once with 256 streaming HTTP clients (uvicorn
  serving ``openai_router`` here, a load generator in another process). Method: a CUDA
  event is recorded on the runner's stream before and after each step's launches
  (``execute``, or ``submit`` for a pipelined runner); over consecutive steps that both
  carry all 256 requests, idle = sum(end_i -> start_i+1) / sum(start_i -> start_i+1) on the
  device's own clock. Time inside a step's span counts as busy, so this is the idle time the
  host adds between steps (scheduling, output handling, the frontend holding the GIL).

Exits 3 with a 'skipped' record when there is no CUDA device, unless ``--rehearsal``: then
the same waves run on the CPU at tiny shapes (a 2-layer model of the SmolLM2 kind, float32,
1, 2 and 4 requests of 4 tokens, 4 HTTP clients), through the pipelined engine loop and the
uncaptured static decode step (see ``_gpu.runner_as_on_cuda``), host clocks standing in for
CUDA events. Prints a table; ``--json PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _gpu
from _common import chat_messages, median, percentile, write_json

CONCURRENCY = (1, 64, 256)
NEW_TOKENS = 128
REHEARSAL_CONCURRENCY = (1, 2, 4)
REHEARSAL_NEW_TOKENS = 48  # NOTE: long enough that the streams overlap on a loaded machine
TARGETS = {"throughput_vs_generate_at_64": 5.0, "idle_share_http_256": 0.05}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    full = max(args.concurrency)
    return {
        "device": args.device,
        "dtype": _gpu.model_dtype(args.device),
        "attention_backend": args.attention_backend,
        "max_num_seqs": full,
        "max_num_batched_tokens": 8192,
        "max_model_len": 2048 if args.device == "cuda" else 256,
        "num_kv_blocks": full * 16 + 64,
    }


def prompts(tokenizer: Any, count: int) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                chat_messages(i), add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for i in range(count)
    ]


# -- transformers ----------------------------------------------------------------------------


def time_generate(model: Any, input_ids: Any, mask: Any, new_tokens: int) -> float:
    """Seconds for one greedy ``generate`` of exactly ``new_tokens`` tokens per row."""
    import torch

    device = str(input_ids.device.type)
    _gpu.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=2,
        )
    _gpu.synchronize(device)
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def transformers_rows(
    folder: Path, ids: list[list[int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    device, new_tokens = args.device, args.new_tokens
    dtype = getattr(torch, _gpu.model_dtype(device))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    rows = []
    for c in args.concurrency:
        batch = ids[:c]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[2] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        time_generate(model, input_ids, mask, 2)  # warm-up: kernels, allocator
        ttft = time_generate(model, input_ids, mask, 1)
        wall = time_generate(model, input_ids, mask, new_tokens)
        rows.append(
            {
                "system": "transformers generate",
                "concurrency": c,
                "tokens_per_s": c * new_tokens / wall,
                "wall_s": wall,
                "ttft_ms_p50": ttft * 1e3,
                "ttft_ms_p99": ttft * 1e3,
                "itl_ms_p50": (wall - ttft) / (new_tokens - 1) * 1e3,
                "itl_ms_p99": None,
            }
        )
        print(f"  transformers c={c}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    del model
    gc.collect()
    _gpu.empty_cache(device)
    return rows


# -- inlinelm --------------------------------------------------------------------------------


class StepTimeline:
    """CUDA events around every step the engine thread launches (see the module docstring)."""

    def __init__(self, runner: Any, device: str) -> None:
        self.runner = runner
        self.device = device
        self.steps: list[tuple[Any, Any, int, bool]] = []  # start, end, rows, all decode
        self.recording = False

    def install(self) -> None:
        # NOTE: one method only: a runner's execute may call its own submit.
        name = "submit" if hasattr(self.runner, "submit") else "execute"
        setattr(self.runner, name, self._timed(getattr(self.runner, name)))

    def _timed(self, launch: Any) -> Any:
        import torch

        def timed(batch: Any) -> Any:
            if not self.recording:
                return launch(batch)
            stream = None
            if self.device == "cuda":
                own = getattr(self.runner, "stream", None)
                stream = own if isinstance(own, torch.cuda.Stream) else torch.cuda.current_stream()
            start, end = _gpu.event(self.device), _gpu.event(self.device)
            start.record(stream)
            try:
                return launch(batch)
            finally:
                end.record(stream)
                decode = all(item.num_tokens == 1 for item in batch.scheduled)
                self.steps.append((start, end, len(batch.scheduled), decode))

        return timed

    def take(self, full_batch: int) -> dict[str, Any]:
        steps, self.steps = self.steps, []
        idle = period = 0.0
        periods: list[float] = []
        for (s0, e0, n0, d0), (s1, _, n1, d1) in itertools.pairwise(steps):
            if not (n0 == n1 == full_batch and d0 and d1):
                continue
            e0.synchronize()
            s1.synchronize()
            gap, whole = e0.elapsed_time(s1), s0.elapsed_time(s1)
            idle += gap
            period += whole
            periods.append(whole)
        return {
            "steps": len(steps),
            "full_batch_step_pairs": len(periods),
            "device_step_period_ms_p50": median(periods),
            "idle_share": idle / period if period else None,
        }


async def engine_wave(engine: Any, ids: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from inlinelm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    async def one(prompt: list[int]) -> tuple[float | None, list[float], int]:
        t0 = time.perf_counter()
        first, last, gaps, count = None, None, [], 0
        async for out in engine.stream(prompt, params):
            now = time.perf_counter()
            n = len(out.token_ids)
            if n == 0:
                continue
            if first is None:
                first = now - t0
            elif last is not None:
                gaps.extend([(now - last) / n] * n)
            last, count = now, count + n
        return first, gaps, count

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in ids))
    wall = time.perf_counter() - t0
    ttfts = [r[0] * 1e3 for r in results if r[0] is not None]
    itls = [g * 1e3 for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    assert tokens == len(ids) * new_tokens, (tokens, len(ids) * new_tokens)
    return {
        "system": "inlinelm",
        "concurrency": len(ids),
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "ttft_ms_p50": median(ttfts),
        "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_p50": median(itls),
        "itl_ms_p99": percentile(itls, 99),
    }


async def http_wave(engine: Any, batch: int, new_tokens: int) -> dict[str, Any]:
    """256 streaming HTTP clients (another process) against uvicorn serving the router here."""
    import uvicorn

    from inlinelm.api import openai_router
    from interference import _receive, client_process, free_socket

    sock = free_socket()
    port = sock.getsockname()[1]
    app = openai_router(engine, model_name="default")
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=client_process, args=(port, batch, new_tokens, 120.0, child), daemon=True
        )
        proc.start()
        child.close()
        client = await asyncio.to_thread(_receive, parent, 150.0)
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
    if "error" in client:
        raise RuntimeError(client["error"])
    streams = client["streams"]
    return {
        "complete_streams": sum(1 for s in streams if s["complete"]),
        "statuses": sorted({s["status"] for s in streams}),
        "client_wall_s": client["wall_s"],
    }


async def inlinelm_rows(
    folder: Path, ids: list[list[int]], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from inlinelm import Engine

    config = _gpu.engine_config(model=str(folder), **engine_options(args))
    rows: list[dict[str, Any]] = []
    idle: dict[str, Any] = {}
    async with Engine(config) as engine:
        assert engine._handle.core is not None  # started by the context manager
        core = engine._handle.core
        idle["engine_loop"] = "pipelined" if core.config.async_scheduling else "plain"
        timeline = StepTimeline(core.runner, args.device)
        timeline.install()
        await engine_wave(engine, ids[:4], 8)  # warm-up
        for c in args.concurrency:
            timeline.recording = c == max(args.concurrency)
            rows.append(await engine_wave(engine, ids[:c], args.new_tokens))
            print(f"  inlinelm c={c}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
        timeline.recording = False
        full = max(args.concurrency)
        idle["in_process_256"] = timeline.take(full)
        try:
            timeline.recording = True
            wave = await http_wave(engine, full, args.new_tokens)
            timeline.recording = False
            idle["http_256"] = {**timeline.take(full), **wave}
        except Exception as e:
            timeline.recording = False
            idle["http_256"] = {"error": _gpu.error_text(e)}
    return rows, idle


def verdicts(rows: list[dict[str, Any]], idle: dict[str, Any], middle: int = 64) -> dict[str, Any]:
    """The H200 targets; ``middle`` is the concurrency of the throughput ratio (64; the
    rehearsal's middle wave off CUDA)."""

    def tps(system: str, c: int) -> float | None:
        for r in rows:
            if r["system"] == system and r["concurrency"] == c:
                return float(r["tokens_per_s"])
        return None

    ours, theirs = tps("inlinelm", middle), tps("transformers generate", middle)
    ratio = ours / theirs if ours and theirs else None
    share = idle.get("http_256", {}).get("idle_share")
    return {
        "throughput_vs_generate_at_64": {
            "measured": ratio,
            "target": TARGETS["throughput_vs_generate_at_64"],
            "met": None if ratio is None else ratio >= TARGETS["throughput_vs_generate_at_64"],
        },
        "idle_share_http_256": {
            "measured": share,
            "target": TARGETS["idle_share_http_256"],
            "met": None if share is None else share <= TARGETS["idle_share_http_256"],
        },
    }


def print_table(rows: list[dict[str, Any]], idle: dict[str, Any], verdict: dict[str, Any]) -> None:
    def f(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, float | int) else "-".rjust(int(spec.split(".")[0]))

    print(
        f"\n{'system':<22} {'conc':>4} {'tokens/s':>9} {'wall s':>7} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
    )
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["system"])):
        print(
            f"{r['system']:<22} {r['concurrency']:>4} {f(r['tokens_per_s'], '9.0f')} "
            f"{f(r['wall_s'], '7.2f')} {f(r['ttft_ms_p50'], '9.1f')} {f(r['ttft_ms_p99'], '9.1f')} "
            f"{f(r['itl_ms_p50'], '8.2f')} {f(r['itl_ms_p99'], '8.2f')}"
        )
    print("(ms; transformers TTFT = generate(max_new_tokens=1) on the batch, ITL = the mean)")
    for name, v in idle.items():
        print(f"idle between steps, {name}: {v}")
    print("\ntargets (H200):")
    for key, v in verdict.items():
        value = "n/a" if v["measured"] is None else f"{v['measured']:.3f}"
        print(f"  {key:<30} measured {value:>8}  target {v['target']}  met: {v['met']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--skip-transformers", action="store_true")
    _gpu.add_rehearsal_argument(parser)
    args = parser.parse_args()
    args.device = _gpu.pick_device(args.rehearsal, args.json, "gpu_e2e")
    on_cuda = args.device == "cuda"
    args.concurrency = CONCURRENCY if on_cuda else REHEARSAL_CONCURRENCY
    if args.new_tokens is None:
        args.new_tokens = NEW_TOKENS if on_cuda else REHEARSAL_NEW_TOKENS
    import torch
    from transformers import AutoTokenizer

    rows: list[dict[str, Any]] = []
    idle: dict[str, Any] = {}
    errors: list[str] = []
    shape = _gpu.smollm2_config() if on_cuda else _gpu.tiny_shape(_gpu.smollm2_config(), 2)
    dtype = getattr(torch, _gpu.model_dtype(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        folder = _gpu.write_random_model(Path(tmp) / "smollm2-random", shape, dtype)
        ids = prompts(AutoTokenizer.from_pretrained(str(folder)), max(args.concurrency))
        try:
            with _gpu.runner_as_on_cuda(args.device):
                ours, idle = asyncio.run(inlinelm_rows(folder, ids, args))
            rows.extend(ours)
        except Exception as e:
            errors.append(f"inlinelm: {_gpu.error_text(e)}")
            print(errors[-1], flush=True)
        if not args.skip_transformers:
            rows.extend(transformers_rows(folder, ids, args))
    verdict = verdicts(rows, idle, sorted(args.concurrency)[1])
    print_table(rows, idle, verdict)
    for error in errors:
        print(f"error: {error}")
    write_json(
        args.json,
        {
            "device": _gpu.device_name(args.device),
            "rehearsal": not on_cuda,
            "torch": torch.__version__,
            "new_tokens": args.new_tokens,
            "prompt_tokens": [len(p) for p in ids],
            "rows": rows,
            "idle": idle,
            "errors": errors,
            "targets": verdict,
        },
    )
    failed = errors or any("error" in v for v in idle.values() if isinstance(v, dict))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
