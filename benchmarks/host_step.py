"""Host time per engine step with the forward left out: an older commit and this tree, side by side.

What one decode step costs the engine thread in Python, numpy and torch dispatch, which it
holds the GIL for: ``Scheduler.schedule()``, ``ModelRunner.execute()`` (sync rows,
``InputBatch.prepare``, staging, sampling metadata, the sampler, the output record) and
``Scheduler.update_from_output()`` (the engine's output records). Batches of 1, 64 and 256
decoding requests, greedy and "sampled" (temperature 0.8, top-p 0.9, top-k 50, repetition
penalty 1.1, presence 0.5, frequency 0.3), on this CPU with one intra-op thread.

How the forward is left out: the runner's model is replaced by a stand-in that copies
preallocated logits of a small vocabulary (``--vocab``, default 256) into an output buffer;
the stand-in times its own copy and that time is subtracted. Two more parts are timed and
reported apart, not counted: the attention backend's ``prepare`` (the CPU torch backend's
per-group metadata here; FlashInfer's plan on a GPU) and the sampler call. The sampler's
tensor ops compute on the CPU here (a sort of ``[256, 256]`` alone takes ~5 ms on one core),
work a GPU does asynchronously; its host side is counted as the same sampler, same settings,
on one row (``sampler 1`` column: every op dispatched, its kernels nearly free), which is
what a batch costs the host too, since the sampler's ops are batched. So the host total is
schedule + prepare (``execute`` less the forward, the attention prepare and the sampler) +
update + the one-row sampler. The ``sampler B`` column (the whole call at batch B on this
CPU, kernels included) shows what was left out.

"Base" is a git worktree of ``--base`` (default e7cb4d4, the code before the step path's
one-copy staging and the persistent sampling batch) made by this script under
``/tmp/host-step-base-<rev>``; "new" is this checkout's ``src``. Each round runs one child
process per tree (``PYTHONPATH`` at that tree's ``src``; the child checks which
``inlinelm`` it imported), alternating which goes first; a child measures every batch and
mode and reports the median step of each. The table gives the median over rounds and the
ratio new / base. Targets (issue 20): at batch 256 new ≤ 0.5 × base, and ≤ 0.5 ms sampled.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import load_average, median, write_json  # noqa: E402

PROMPT_LEN = 64
BATCHES = (1, 64, 256)
MODES = ("greedy", "sampled")
SAMPLED = {
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 50,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
}
PARTS = ("schedule", "prepare", "update")


# -- child: one tree, every batch and mode ---------------------------------------------


class StandInModel:
    """Returns ready logits: a copy of a preallocated ``[rows, vocab]`` tensor, timed."""

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        import torch

        generator = torch.Generator().manual_seed(0)
        self.source = torch.randn(max_rows, vocab_size, generator=generator) * 3
        self.out = torch.empty_like(self.source)
        self.seconds = 0.0

    def __call__(
        self, input_ids: Any, positions: Any, kv_caches: Any, meta: Any, index: Any
    ) -> Any:
        start = time.perf_counter()
        rows = len(index)
        logits = self.out[:rows]
        logits.copy_(self.source[:rows])
        self.seconds += time.perf_counter() - start
        return logits


class Timed:
    """Wraps a callable and adds the seconds of each call to ``seconds``."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.seconds = 0.0

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.call(*args)
        self.seconds += time.perf_counter() - start
        return result


def sampler_host_seconds(runner: Any, params: Any, vocab: int) -> float:
    """The sampler's call on one row with the same settings: its host side, kernels ~free."""
    import torch

    from inlinelm.gpu.sampling.metadata import SamplingMetadata

    prompt = [3 + j % (vocab - 3) for j in range(PROMPT_LEN)]
    meta = SamplingMetadata.build([params], [prompt], [[5, 6]], [None], vocab, torch.device("cpu"))
    logits = torch.randn(1, vocab)
    times = []
    for _ in range(30):
        row = logits.clone()
        start = time.perf_counter()
        runner.sampler(row, meta)
        times.append(time.perf_counter() - start)
    return median(times)


def measure(folder: Path, batch: int, mode: str, steps: int, vocab: int) -> dict[str, float]:
    """Median seconds per decode step of each part at ``batch`` (see the module docstring)."""
    from inlinelm.config import EngineConfig
    from inlinelm.gpu.model_runner import ModelRunner
    from inlinelm.sampling_params import SamplingParams
    from inlinelm.sched.request import Request
    from inlinelm.sched.scheduler import Scheduler

    block_size = 16
    warm = 8
    num_blocks = batch * -(-(PROMPT_LEN + warm + steps + 2) // block_size) + 8
    config = EngineConfig(
        model=str(folder),
        num_threads=1,
        num_kv_blocks=num_blocks,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch),
        block_size=block_size,
        enable_prefix_caching=False,
    )
    runner = ModelRunner(config, folder)
    stand_in = StandInModel(batch, vocab)
    runner.model = stand_in
    options = SAMPLED if mode == "sampled" else {"temperature": 0.0}
    params = SamplingParams(max_tokens=warm + steps + 1, ignore_eos=True, **options)
    sampler_host = sampler_host_seconds(runner, params, vocab)
    sampler = runner.sampler = Timed(runner.sampler)
    attention = runner.backend.prepare = Timed(runner.backend.prepare)
    scheduler = Scheduler(config, runner.num_kv_blocks, 2)
    for i in range(batch):
        prompt = [3 + (i * 31 + j * 7) % (vocab - 3) for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"r{i}", prompt, params, 2))
    times: dict[str, list[float]] = {part: [] for part in (*PARTS, "sampler", "attention")}
    done = 0
    gc.collect()
    while scheduler.has_unfinished_requests() and len(times["update"]) < steps:
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        stand_in.seconds = sampler.seconds = attention.seconds = 0.0
        result = runner.execute(out)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, result)
        t3 = time.perf_counter()
        decoding = len(out.scheduled) == batch and all(s.num_tokens == 1 for s in out.scheduled)
        done += decoding
        if decoding and done > warm:
            times["schedule"].append(t1 - t0)
            excluded = stand_in.seconds + sampler.seconds + attention.seconds
            times["prepare"].append(t2 - t1 - excluded)
            times["update"].append(t3 - t2)
            times["sampler"].append(sampler.seconds)
            times["attention"].append(attention.seconds)
    runner.close()
    host = [
        times["schedule"][i] + times["prepare"][i] + times["update"][i] + sampler_host
        for i in range(len(times["update"]))
    ]
    result_ms = {part: median(v) for part, v in times.items()}
    return {**result_ms, "sampler_host": sampler_host, "total": median(host)}


def child(args: argparse.Namespace) -> None:
    import inlinelm

    src = Path(inlinelm.__file__).resolve().parents[1]
    if src != Path(args.expect_src).resolve():
        sys.exit(f"imported inlinelm from {src}, expected {args.expect_src}")
    results = {
        f"{batch}/{mode}": measure(Path(args.model), batch, mode, args.steps, args.vocab)
        for batch in args.batches
        for mode in MODES
    }
    print(json.dumps(results))


# -- parent: worktree, rounds, table --------------------------------------------------


def base_tree(rev: str) -> Path:
    """A detached worktree of ``rev`` (made once, reused while it matches)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"host-step-base-{sha[:7]}"
    if not (tree / "src" / "inlinelm").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), sha],
            check=True,
            capture_output=True,
        )
    return tree


def write_model(folder: Path, vocab: int) -> None:
    """A one-layer random Llama of ``vocab`` tokens (its weights are never run)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def run_child(src: Path, args: argparse.Namespace, model: Path) -> dict[str, dict[str, float]]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--model",
        str(model),
        "--expect-src",
        str(src),
        "--steps",
        str(args.steps),
        "--vocab",
        str(args.vocab),
        "--batches",
        *map(str, args.batches),
    ]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"child for {src} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, dict[str, float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="e7cb4d4", help="git revision measured as the base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per case")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--expect-src", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    started = time.perf_counter()
    load_before = load_average()
    trees = {"base": base_tree(args.base) / "src", "new": ROOT / "src"}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_model(model, args.vocab)
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(run_child(trees[name], args, model))
    report(args, runs, load_before, time.perf_counter() - started)


def report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, dict[str, float]]]],
    load_before: str,
    seconds: float,
) -> None:
    def ms(name: str, case: str, part: str) -> float:
        return 1e3 * median([run[case][part] for run in runs[name]])

    print(
        f"host_step: base {args.base} vs this tree, vocab {args.vocab}, {args.steps} decode steps "
        f"x {args.rounds} rounds, prompt {PROMPT_LEN} tokens; load average {load_before} before, "
        f"{load_average()} after; {seconds:.0f} s"
    )
    extra = ("sampler_host", "sampler", "attention")
    names = {"sampler_host": "sampler 1", "sampler": "sampler B", "attention": "attn prep"}
    print(
        f"{'B':>4} {'mode':>8} {'base ms':>8} {'new ms':>8} {'new/base':>8}   "
        + " ".join(f"{names.get(p, p) + ' b/n':>15}" for p in (*PARTS, *extra))
    )
    rows = []
    for case in runs["new"][0]:
        batch, mode = case.split("/")
        base, new = ms("base", case, "total"), ms("new", case, "total")
        parts = {p: (ms("base", case, p), ms("new", case, p)) for p in (*PARTS, *extra)}
        cells = " ".join(f"{b:>7.3f}/{n:<7.3f}" for b, n in parts.values())
        print(f"{batch:>4} {mode:>8} {base:>8.3f} {new:>8.3f} {new / base:>8.2f}   {cells}")
        rows.append(
            {"batch": int(batch), "mode": mode, "base_ms": base, "new_ms": new, "ratio": new / base}
            | {f"{p}_ms": {"base": b, "new": n} for p, (b, n) in parts.items()}
        )
    big = [row for row in rows if row["batch"] == max(args.batches)]
    for row in big:
        verdict = "met" if row["ratio"] <= 0.5 else "missed"
        print(
            f"B={row['batch']} {row['mode']}: new/base {row['ratio']:.2f} (target <= 0.5, {verdict})"
        )
        if row["mode"] == "sampled":
            verdict = "met" if row["new_ms"] <= 0.5 else "missed"
            print(f"B={row['batch']} sampled: {row['new_ms']:.3f} ms (target <= 0.5 ms, {verdict})")
    write_json(
        args.json,
        {
            "base": args.base,
            "vocab": args.vocab,
            "steps": args.steps,
            "rounds": args.rounds,
            "load_average": {"before": load_before, "after": load_average()},
            "rows": rows,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
