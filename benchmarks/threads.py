"""CPU threads on an idle and on a busy machine: the default model's decode with every core,
with one thread and with the default rule, side by side.

The workload: ``--prompts`` prompts (2) decoding together, greedy with ``ignore_eos``, on
the default model, timed in blocks of ``--block`` tokens (8), ``--rounds`` blocks (6) per
configuration. Configurations:

* ``all``: every usable core (the default before the rule);
* ``1``: one thread;
* ``default``: ``num_threads`` unset (:mod:`inlinelm.gpu.cpu_threads`: the cores other
  processes leave idle, re-checked every second);
* ``all-passive``: every core with ``OMP_WAIT_POLICY=PASSIVE`` in the process's
  environment, so that libgomp's waiting threads sleep instead of spinning (it isolates
  the spin-wait; libgomp reads the variable only when torch loads it).

``all``, ``1`` and ``default`` share one child process and one engine, which runs their
blocks in turn (the order reversed every round) with the runner's thread count swapped
between blocks, so all three see the same background load; ``all-passive`` runs in a
child of its own. Conditions: ``idle`` (nothing of this benchmark's beside the children;
other users' processes may still run, see the "others" column) and ``burner`` (a process
spinning one core, started before the engine and stopped after it); every repeat runs
both, their order alternating, and within one the two children alternate.

Per block: milliseconds per decode step (the block's wall time / its tokens), the child's
CPU time per step (all its threads: spinning shows up here), split into the engine
thread's and the other threads' (OpenMP workers, the event loop, tokenizer and grammar
threads; ``/proc/self/task``), the threads used, and how many cores' worth of time other
processes used meanwhile (``/proc/stat`` less the child's own CPU time). The table gives
medians over every block of a configuration and condition, and each configuration's time
as a ratio of ``all`` and of ``1`` in the same condition. Prints the table, writes
``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import load_average, median, write_json  # noqa: E402

CONFIGS = ("all", "1", "default", "all-passive")
SHARED = ("all", "1", "default")
"""The configurations one child runs in turn (the same process, the same background)."""
CONDITIONS = ("idle", "burner")
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a CPU cache works, step by step.",
    "List some tips for learning a new language.",
    "Describe the water cycle to a child.",
]
BURNER = "while True:\n    pass\n"
COLUMNS = (
    "ms_per_step",
    "cpu_ms_per_step",
    "engine_cpu_ms_per_step",
    "rest_cpu_ms_per_step",
    "others_cores",
)


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each of this process's threads, by native id (``/proc/self/task``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    times = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        times[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return times


def child(args: argparse.Namespace) -> None:
    """One child: an engine on the default model, each of its configurations' blocks in
    turn; prints one JSON object, {config: [block, ...]}."""
    from inlinelm import Engine
    from inlinelm.gpu.cpu_threads import CpuThreads, usable_cores

    configs = SHARED if args.child == "shared" else ("all-passive",)
    cores = usable_cores()
    engine = Engine(model="default", num_threads=cores, max_num_seqs=args.prompts)
    prompts = PROMPTS[: args.prompts]
    try:
        engine.start_sync()
        engine.generate(prompts, max_tokens=4, temperature=0.0, use_tqdm=False)
        # NOTE: the benchmark swaps the runner's thread count between blocks, while the
        # engine thread waits for requests; the default's own instance keeps its readings.
        core = engine._submitter.require_loaded().core
        runner = core.runner
        counts = {"all": cores, "all-passive": cores, "1": 1, "default": None}
        threads = {config: CpuThreads(counts[config]) for config in configs}
        engine_tid = core._thread.native_id if core._thread is not None else None
        blocks: dict[str, list[dict[str, Any]]] = {config: [] for config in configs}
        for r in range(args.rounds):
            for config in configs if r % 2 == 0 else tuple(reversed(configs)):
                runner.cpu_threads = threads[config]  # type: ignore[attr-defined]
                blocks[config].append(time_block(engine, prompts, args.block, engine_tid))
                blocks[config][-1]["threads"] = threads[config].num_threads
    finally:
        engine.close()
    print(json.dumps(blocks))


def time_block(
    engine: Any, prompts: list[str], tokens: int, engine_tid: int | None
) -> dict[str, Any]:
    """Decode ``tokens`` tokens for ``prompts``; what the block cost, per step."""
    from inlinelm.gpu.cpu_threads import affinity_cpus, read_cpu_times

    cpus = affinity_cpus()
    tasks, before = thread_cpu_s(), read_cpu_times(cpus)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.generate(prompts, max_tokens=tokens, temperature=0.0, ignore_eos=True, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = read_cpu_times(cpus)
    used = {tid: t - tasks.get(tid, 0.0) for tid, t in thread_cpu_s().items()}
    engine_cpu = used.pop(engine_tid, 0.0) if engine_tid is not None else 0.0
    others = None
    if before is not None and after is not None:
        others = (after.busy_s - before.busy_s - (after.own_s - before.own_s)) / wall
    return {
        "ms_per_step": wall / tokens * 1e3,
        "cpu_ms_per_step": cpu / tokens * 1e3,
        "engine_cpu_ms_per_step": engine_cpu / tokens * 1e3,
        "rest_cpu_ms_per_step": sum(used.values()) / tokens * 1e3,
        "others_cores": others,
    }


def run_child(args: argparse.Namespace, which: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", which]
    cmd += [
        "--block",
        str(args.block),
        "--rounds",
        str(args.rounds),
        "--prompts",
        str(args.prompts),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if which == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, check=False, timeout=args.timeout
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_condition(args: argparse.Namespace, condition: str, order: list[str]) -> dict[str, Any]:
    """Both children under ``condition``, in ``order``: {config: [block, ...]}."""
    burner = None
    if condition == "burner":
        burner = subprocess.Popen([sys.executable, "-c", BURNER])
    try:
        blocks: dict[str, Any] = {}
        for which in order:
            result = run_child(args, which)
            if "error" in result:
                print(
                    f"  {condition:<6} {which}: error: {result['error'].strip().splitlines()[-1]}"
                )
                continue
            blocks.update(result)
            for config, rows in result.items():
                row = summary(rows)
                print(
                    f"  {condition:<6} {config:<11} {row['ms_per_step']:8.1f} ms/step, CPU "
                    f"{row['cpu_ms_per_step']:7.1f} ms/step (engine thread "
                    f"{row['engine_cpu_ms_per_step']:.1f}, other threads "
                    f"{row['rest_cpu_ms_per_step']:.1f}), threads {row['threads']}, others "
                    f"{row['others_cores']:.2f} cores",
                    flush=True,
                )
        return blocks
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of every column over ``rows`` and the thread counts seen."""
    out: dict[str, Any] = {
        key: median([r[key] for r in rows if r[key] is not None]) for key in COLUMNS
    }
    out["threads"] = ",".join(str(t) for t in sorted({r["threads"] for r in rows}))
    out["blocks"] = len(rows)
    return out


def summarise(runs: list[dict[str, dict[str, list[dict[str, Any]]]]]) -> dict[str, Any]:
    """Per condition and configuration: medians over every block of every repeat, and the
    ratios to ``all`` and to ``1`` in the same condition."""
    table: dict[str, Any] = {}
    for condition in CONDITIONS:
        rows = {}
        for config in CONFIGS:
            blocks = [b for run in runs for b in run.get(condition, {}).get(config, [])]
            if blocks:
                rows[config] = summary(blocks)
        for row in rows.values():
            for base in ("all", "1"):
                if base in rows:
                    row[f"vs_{base}"] = row["ms_per_step"] / rows[base]["ms_per_step"]
        table[condition] = rows
    return table


def print_table(table: dict[str, Any]) -> None:
    print(
        f"{'condition':<9} {'config':<11} {'ms/step':>8} {'x all':>6} {'x 1':>6} "
        f"{'CPU ms/step':>11} {'engine':>7} {'rest':>7} {'threads':>7} {'others':>7}"
    )
    for condition, rows in table.items():
        for config, row in rows.items():
            print(
                f"{condition:<9} {config:<11} {row['ms_per_step']:>8.1f} "
                f"{row.get('vs_all', float('nan')):>6.2f} {row.get('vs_1', float('nan')):>6.2f} "
                f"{row['cpu_ms_per_step']:>11.1f} {row['engine_cpu_ms_per_step']:>7.1f} "
                f"{row['rest_cpu_ms_per_step']:>7.1f} {row['threads']:>7} "
                f"{row['others_cores']:>7.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", type=int, default=8, help="decode steps per timed block")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per configuration")
    parser.add_argument("--prompts", type=int, default=2, help="prompts decoded together")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=("shared", "passive"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    started = time.perf_counter()
    load_before = load_average()
    print(
        f"threads: {args.prompts} prompts, {args.rounds} blocks of {args.block} steps per "
        f"configuration, greedy, default model, {len(os.sched_getaffinity(0))} cores; "
        f"load average {load_before}"
    )
    runs = []
    for r in range(args.repeats):
        conditions = args.conditions if r % 2 == 0 else list(reversed(args.conditions))
        runs.append(
            {
                condition: run_condition(
                    args,
                    condition,
                    ["shared", "passive"] if (r + i) % 2 == 0 else ["passive", "shared"],
                )
                for i, condition in enumerate(conditions)
            }
        )
    table = summarise(runs)
    print(
        f"medians over {args.repeats} repeat(s); load average {load_before} before, "
        f"{load_average()} after; {time.perf_counter() - started:.0f} s"
    )
    print_table(table)
    write_json(args.json, {"table": table, "runs": runs, "load_before": load_before})


if __name__ == "__main__":
    main()
