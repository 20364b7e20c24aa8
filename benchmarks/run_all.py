"""Run the CPU benchmarks one after the other within about 10 minutes (``make bench``).

Each benchmark runs in its own process with its default (short) settings, prints its table
and writes ``benchmarks/results/<name>.json`` and its PNG. A summary of the targets follows.
``--only NAME ...`` picks some; ``--budget`` caps the total time (a benchmark that would
start past it is skipped, and each one is stopped at its own time limit).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# name, script, extra arguments, time limit in seconds
BENCHMARKS: list[tuple[str, str, list[str], int]] = [
    ("frontend", "frontend.py", [], 150),
    ("interference", "interference.py", [], 150),
    ("detok", "detok.py", [], 90),
    ("prompt_stall", "prompt_stall.py", [], 120),
    ("host_step", "host_step.py", [], 150),
    ("stop_strings", "stop_strings.py", [], 90),
    ("e2e_cpu", "e2e_cpu.py", [], 480),
    ("ray_scale", "ray_scale.py", [], 300),
    ("family_step", "family_step.py", [], 300),
    ("quantized_cpu", "quantized_cpu.py", [], 300),
    ("cpu_step", "cpu_step.py", [], 300),
    ("vs_llama_cpp", "vs_llama_cpp.py", [], 300),
    ("quality_vs_llama_cpp", "quality_vs_llama_cpp.py", [], 900),
    ("vs_llama_server", "vs_llama_server.py", [], 600),
    ("block_memory", "block_memory.py", ["--skip-7b"], 300),
]
NEEDS = {
    "vs_llama_cpp": "llama_cpp",
    "quality_vs_llama_cpp": "llama_cpp",
}
"""A benchmark's module that inlinelm does not install (skipped without it)."""
SERVER_ENV = "LLAMA_SERVER"
"""vs_llama_server.py's llama-server binary (skipped without it; benchmarks/README.md says
how to build one)."""


def summary(name: str, data: dict) -> str:
    if name == "frontend":
        r = data["results"]
        big = r[max(r, key=int)]
        return (
            f"B={max(r, key=int)}: {big['total_us_per_token']:.2f} µs/token "
            f"({big['with_stop']['total_us_per_token']:.2f} with stop strings), "
            f"target <= {data['target_us_per_token']} µs; floors sum {data['floors']['sum_us']:.2f} µs"
        )
    if name == "interference":
        rows = data["rows"]
        last = max(rows, key=lambda row: row["batch"])
        return (
            f"B={last['batch']}: stretch {last.get('stretch', float('nan')):.3f} (target <= "
            f"{data['target_stretch']}), ITL p50/p99 {last['itl_ms_p50']:.1f}/{last['itl_ms_p99']:.1f} ms; "
            f"coalescing starts at B = {data['coalescing_starts_at']}"
        )
    if name == "e2e_cpu":
        v = data["verdicts"]
        text = f"(a) {v['a_ms_per_token']:.1f} ms/token (target <= 20)"
        if "b_throughput_vs_continuous" in v:
            text += (
                f"; (b) {v['b_throughput_vs_continuous']:.2f}x continuous batching's tokens/s "
                f"(target >= 3), their TTFT p50 / ours {v['b_ttft_p50_theirs_over_ours']:.2f} (target >= 5)"
            )
        return text
    if name == "prompt_stall":
        rows = data["rows"]
        return (
            f"1 MB prompt: others' largest gap {rows['completion']['on_loop_ms']:.0f} ms on the loop, "
            f"{rows['completion']['off_loop_ms']:.0f} ms off it (floor {data['floor_ms']:.0f} ms; "
            f"chat {rows['chat']['on_loop_ms']:.0f} → {rows['chat']['off_loop_ms']:.0f} ms)"
        )
    if name == "host_step":
        rows = [r for r in data["rows"] if r["batch"] == max(r["batch"] for r in data["rows"])]
        return (
            "; ".join(
                f"B={r['batch']} {r['mode']}: {r['new_ms']:.2f} ms host per step, "
                f"{r['ratio']:.2f}x of {data['base']}"
                for r in rows
            )
            + " (targets: <= 0.5x, <= 0.5 ms sampled)"
        )
    if name == "ray_scale":
        tight = {r["routing"]: r for r in data["routing"] if r["cache"] == "tight"}
        return (
            f"2 replicas / 1: {data['scaling']['prefix']['ratio_2_over_1']:.2f}x tokens/s; tight "
            f"cache: hit rate prefix {tight['prefix']['hit_rate']:.0%}, serve {tight['serve']['hit_rate']:.0%}"
        )
    if name == "family_step":
        parts = []
        for batch in (1, 32):
            rows = [r for r in data["rows"] if r["batch"] == batch]
            low = min(rows, key=lambda r: r["theirs_over_ours"])
            parts.append(
                f"B={batch}: transformers / ours {low['theirs_over_ours']:.2f}x "
                f"({low['family']}) to {max(r['theirs_over_ours'] for r in rows):.2f}x"
            )
        return "; ".join(parts) + f" over {len(data['rows']) // 2} families"
    if name == "vs_llama_cpp":
        ms = data["ms_per_token"]
        return "; ".join(
            f"{n}: {ms[n]:.2f} ms/token ({ms[n] / ms['llama.cpp']:.2f}x llama.cpp)" for n in ms
        )
    if name == "quality_vs_llama_cpp":
        return "; ".join(
            f"{t}: ours {r['inlinelm quantized (auto)']:.3f}, llama.cpp {r['llama.cpp']:.3f}"
            for t, r in data["types"].items()
        )
    if name == "vs_llama_server":
        m = data["medians"]
        return "; ".join(
            f"{n}: {r['output_tokens_per_s']:.0f} tok/s, TTFT p50 {r['ttft_ms_p50']:.0f} ms"
            for n, r in m.items()
        )
    if name == "block_memory":
        rows = data["shaped"]
        return "; ".join(
            f"{n}: resident {r['second']['anon_growth'] / r['second']['tensor_bytes']:.3f}x "
            "its quantized weights"
            for n, r in rows.items()
        )
    if name == "cpu_step":
        return "; ".join(
            f"{r['weights']} B={r['batch']}: fused kernels {r['step_speedup']:.2f}x torch's ops "
            f"(rest {r['torch_ops_rest_ms']:.1f} -> {r['fused_rest_ms']:.1f} ms)"
            for r in data["results"]
        )
    return "see its table"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[b[0] for b in BENCHMARKS])
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for everything")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done: dict[str, str] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name, script, extra, limit in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        left = args.budget - (time.perf_counter() - start)
        if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
            done[name] = f"skipped: {NEEDS[name]} is not installed (see {script})"
            continue
        if name == "vs_llama_server":
            if not os.environ.get(SERVER_ENV):
                done[name] = f"skipped: ${SERVER_ENV} names no llama-server binary (see {script})"
                continue
            extra = [*extra, "--server", os.environ[SERVER_ENV]]
        if left < 30:
            done[name] = f"skipped: {left:.0f} s of the budget left"
            continue
        out = RESULTS / f"{name}.json"
        cmd = [sys.executable, str(HERE / script), "--json", str(out), *extra]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=min(limit, left), check=False)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {min(limit, left):.0f} s"
        took = time.perf_counter() - t0
        if status == "ok" and out.exists() and script != "detok.py":
            try:
                status = summary(name, json.loads(out.read_text()))
            except (KeyError, ValueError) as e:
                status = f"ok (no summary: {e!r})"
        done[name] = f"{status} [{took:.0f} s]"
    print(
        f"\n=== summary ({time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.2f})"
    )
    for name, text in done.items():
        print(f"{name:>13}: {text}")
    if any("failed" in t or "timed out" in t for t in done.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
