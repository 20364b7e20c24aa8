"""End to end on this CPU: the default model in fp32, inlinelm against transformers
(``--quantization auto``: inlinelm with the file's quantized blocks, its CPU default,
against the same).

(a) one request, 64 new tokens: TTFT and ms per decoded token, inlinelm and transformers
    ``generate`` alternately, three times each (medians).
(b) 32 concurrent requests with mixed prompt lengths (chat prompts with 0 to ~500 tokens of
    context), 64 new tokens each, all arriving at once: output tokens/s and TTFT p50/p99, for
    inlinelm (``Engine.stream``, token-id prompts), transformers ``generate`` (one static batch,
    left padding) and transformers continuous batching (``ContinuousBatchingManager``, the
    engine behind ``generate_batch``, with per-token timestamps).

transformers runs in a child process with its own torch runtime, driven from this script and
alternating with inlinelm for (a): torch's thread count is process-wide and OpenMP throttles
its idle-spinning when more threads than cores live in one process, so sharing a process
lets either system's settings leak into the other's timings.

Everyone decodes greedily with EOS ignored (inlinelm ``ignore_eos``, ``generate``
``min_new_tokens``, continuous batching ``eos_token_id=-1``), so every request makes exactly
64 tokens; the run checks that, and counts how many of the 32 outputs are identical across
the three. Each system is warmed up first. Prints a table, writes ``--json PATH`` and
benchmarks/results/e2e_cpu.png.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing as mp
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _common import (
    ANSWER,
    QUESTIONS,
    load_average,
    median,
    percentile,
    pyplot,
    save_plot,
    write_json,
)

TARGET_MS_PER_TOKEN = 20.0
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_TTFT_RATIO = 5.0


def make_prompts(tokenizer: Any, count: int, max_context: int) -> list[list[int]]:
    """Chat prompts whose context sizes spread from 0 to ``max_context`` tokens.

    Each context is the words of a chat answer shuffled with the request's own seed, so
    prompts share no more than their system prompt (no free prefix-cache hits).
    """
    vocabulary = (ANSWER + " ".join(QUESTIONS)).split()
    prompts = []
    for i in range(count):
        size = (i * 131) % (max_context + 1)
        rng = random.Random(i)
        words = [rng.choice(vocabulary) for _ in range(size)]
        context_ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        context = tokenizer.decode(context_ids[:size]) if size else ""
        question = QUESTIONS[i % len(QUESTIONS)]
        content = f"{context}\n\n{question}" if context else question
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": content},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


# -- inlinelm --------------------------------------------------------------------------------


async def inlinelm_run(
    prompts: list[list[int]],
    new_tokens: int,
    single: list[int],
    *,
    repeats: int = 3,
    reference: Callable[[], dict[str, Any]] | None = None,
    quantization: str = "none",
) -> dict[str, Any]:
    """(a) ``repeats`` times, alternating with ``reference`` (run off the loop), then (b);
    the engine's weights float32 (``quantization="none"``) or quantized (``"auto"``)."""
    from inlinelm import Engine
    from inlinelm.sampling_params import SamplingParams

    engine = Engine(model="default", dtype="float32", quantization=quantization)
    start = time.perf_counter()
    await engine.start()
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    async def one(prompt: list[int]) -> tuple[list[int], float | None, list[float]]:
        """(output ids, TTFT from the request's metrics, caller-side time of each token)."""
        times: list[float] = []
        ids: list[int] = []
        ttft = None
        async for out in engine.stream(prompt, params):
            times.extend([time.perf_counter()] * len(out.token_ids))
            ids.extend(out.token_ids)
            ttft = out.metrics.ttft
        return ids, ttft, times

    singles: list[dict[str, Any]] = []
    references: list[dict[str, Any]] = []
    try:
        await asyncio.gather(*(one(p) for p in prompts[:4]))  # warm-up
        # (a) one request, alternating with the reference (the engine thread idles meanwhile)
        for _ in range(repeats):
            t0 = time.perf_counter()
            single_ids, single_ttft, single_times = await one(single)
            singles.append(_single_result(single_ttft, single_times, t0, new_tokens))
            singles[-1]["tokens"] = single_ids
            if reference is not None:
                references.append(await asyncio.to_thread(reference))
        # (b) all at once
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        ttfts = [ttft for _, ttft, _ in results if ttft is not None]
        outputs = [ids for ids, _, _ in results]
    finally:
        await engine.aclose()
    b = _batch_result(outputs, ttfts, wall, new_tokens)
    return {
        "load_s": load_s,
        "single": _median_run(singles),
        "batch": b,
        "reference_single": _median_run(references) if references else None,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median ms per token, and every run's ms per token."""
    ordered = sorted(runs, key=lambda r: r["ms_per_token"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["runs_ms_per_token"] = [round(r["ms_per_token"], 2) for r in runs]
    return chosen


def _single_result(
    ttft: float | None, times: list[float], t0: float, new_tokens: int
) -> dict[str, Any]:
    assert len(times) == new_tokens, f"{len(times)} tokens instead of {new_tokens}"
    first = ttft if ttft is not None else times[0] - t0
    return {
        "ttft_ms": first * 1e3,
        "ms_per_token": (times[-1] - (t0 + first)) / (new_tokens - 1) * 1e3,
        "total_s": times[-1] - t0,
    }


def _batch_result(
    outputs: list[list[int]], ttfts: list[float], wall: float, new_tokens: int
) -> dict[str, Any]:
    lengths = {len(o) for o in outputs}
    assert lengths == {new_tokens}, f"output lengths {lengths}, expected {new_tokens}"
    return {
        "wall_s": wall,
        "output_tokens_per_s": len(outputs) * new_tokens / wall,
        "ttft_ms_p50": median(ttfts) * 1e3,
        "ttft_ms_p99": percentile(ttfts, 99) * 1e3,
        "tokens": outputs,
    }


# -- transformers ----------------------------------------------------------------------------


class _StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class TransformersPeer:
    """transformers in a spawned child process; :meth:`call` runs one of its measurements."""

    def __init__(self, folder: Path) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_peer_main, args=(str(folder), child), daemon=True)
        self._proc.start()
        child.close()
        self.info: dict[str, Any] = self._receive()  # sent once the model is loaded and warm

    def call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        return self._receive()

    def close(self) -> None:
        self._conn.send(("exit", ()))
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()

    def _receive(self) -> Any:
        if not self._conn.poll(1800):
            raise RuntimeError("the transformers process sent nothing for 30 minutes")
        result = self._conn.recv()
        if isinstance(result, dict) and "peer_error" in result:
            raise RuntimeError(f"transformers process: {result['peer_error']}")
        return result


def _peer_main(folder: str, conn: Any) -> None:
    """The child process: load transformers' model, warm it up, then serve measurements."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        model, tokenizer = load_hf(Path(folder))
        hf_static(model, tokenizer, [[1, 2, 3, 4]], 4)  # warm-up
        hf_continuous(model, [[1, 2, 3, 4], [5, 6, 7]], 4, 2048)  # warm-up
        conn.send({"torch_threads": torch.get_num_threads()})
        while True:
            name, args = conn.recv()
            if name == "exit":
                return
            if name == "static":
                conn.send(hf_static(model, tokenizer, *args))
            elif name == "continuous":
                conn.send(hf_continuous(model, *args))
    except BaseException as e:
        conn.send({"peer_error": repr(e)})
    finally:
        conn.close()


def load_hf(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    return model, tokenizer


@torch.inference_mode()
def hf_static(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    """``generate`` on one left-padded static batch; TTFT is when the first logits are ready."""
    from transformers import LogitsProcessorList

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt", padding=True)
    clock = _StepClock()
    t0 = time.perf_counter()
    out = model.generate(
        **batch,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([clock]),
        pad_token_id=tokenizer.pad_token_id,
    )
    end = time.perf_counter()
    generated = out[:, batch["input_ids"].shape[1] :].tolist()
    ttft = clock.times[0] - t0
    return {
        "wall_s": end - t0,
        "ttft": ttft,
        "ttft_ms": ttft * 1e3,
        "ms_per_token": (end - clock.times[0]) / (new_tokens - 1) * 1e3,
        "tokens": generated,
    }


@torch.inference_mode()
def hf_continuous(
    model: Any, prompts: list[list[int]], new_tokens: int, max_batch_tokens: int
) -> dict[str, Any]:
    """transformers continuous batching (what ``generate_batch`` runs), timed per token."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(
        max_batch_tokens=max_batch_tokens,
        num_blocks=max(16, -(-sum(len(p) + new_tokens for p in prompts) // 256) * 2),
    )
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, block=True, timeout=10
    ) as manager:
        t0 = time.perf_counter()
        ids = manager.add_requests(
            inputs=prompts, max_new_tokens=new_tokens, record_timestamps=True
        )
        results: dict[str, Any] = {}
        deadline = t0 + 600
        while len(results) < len(prompts) and time.perf_counter() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
        wall = time.perf_counter() - t0
    ordered = [results[i] for i in ids]
    errors = [r.error for r in ordered if r.error]
    if errors:
        raise RuntimeError(f"continuous batching failed: {errors[0]}")
    ttfts = [r.timestamps[0] - t0 for r in ordered]
    return {
        "wall_s": wall,
        "ttfts": ttfts,
        "tokens": [list(r.generated_tokens) for r in ordered],
        "timestamps": [r.timestamps for r in ordered],
    }


# -- driver ----------------------------------------------------------------------------------


def identical(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="(a) runs per system")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=("none", "auto"),
        help='inlinelm\'s weights: "none" float32, as transformers\' (the default), "auto" quantized',
    )
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoTokenizer

    from inlinelm.gpu.loading.model_files import resolve_model

    folder = resolve_model("default").folder
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    peer = None if args.skip_transformers else TransformersPeer(folder)
    prompts = make_prompts(tokenizer, args.requests, args.max_context)
    single = prompts[1]
    n = args.new_tokens
    print(
        f"e2e_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.requests} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"{n} new tokens each; load average {load_average()}",
        flush=True,
    )

    reference = None
    if peer is not None:
        transformers_peer = peer

        def reference() -> dict[str, Any]:
            run: dict[str, Any] = transformers_peer.call("static", [single], n)
            run["tokens"] = run["tokens"][0]
            return run

    ours = asyncio.run(
        inlinelm_run(
            prompts,
            n,
            single,
            repeats=args.repeats,
            reference=reference,
            quantization=args.quantization,
        )
    )
    print(f"  inlinelm and (a) done (load {ours['load_s']:.1f} s)", flush=True)
    gc.collect()
    s1 = ours.pop("reference_single")
    report: dict[str, Any] = {
        "new_tokens": n,
        "requests": args.requests,
        "prompt_tokens": [len(p) for p in prompts],
        "torch_threads": torch.get_num_threads(),
        "quantization": args.quantization,
        "inlinelm": ours,
    }
    if peer is not None and s1 is not None:
        report["transformers_torch_threads"] = peer.info["torch_threads"]
        sb = peer.call("static", prompts, n)
        print("  transformers generate (32) done", flush=True)
        cb = peer.call("continuous", prompts, n, 2048)
        print("  transformers continuous batching done", flush=True)
        peer.close()
        report["transformers_generate"] = {
            "single": {
                k: s1[k] for k in ("ttft_ms", "ms_per_token", "runs_ms_per_token", "tokens")
            },
            "batch": {
                "wall_s": sb["wall_s"],
                "output_tokens_per_s": len(prompts) * n / sb["wall_s"],
                "ttft_ms_p50": sb["ttft"] * 1e3,
                "ttft_ms_p99": sb["ttft"] * 1e3,
                "tokens": sb["tokens"],
            },
        }
        report["transformers_continuous"] = {
            "batch": _batch_result(cb["tokens"], cb["ttfts"], cb["wall_s"], n)
        }
    report["load_average"] = load_average()
    summarize(report)
    print_table(report)
    slim = _without_tokens(report)
    write_json(args.json, slim)
    if not args.no_plot:
        plot(report)


def summarize(report: dict[str, Any]) -> None:
    ours = report["inlinelm"]
    verdicts: dict[str, Any] = {
        "a_ms_per_token": ours["single"]["ms_per_token"],
        "a_target_met": ours["single"]["ms_per_token"] <= TARGET_MS_PER_TOKEN,
    }
    if "transformers_continuous" in report:
        theirs = report["transformers_continuous"]["batch"]
        ratio = ours["batch"]["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        ttft_ratio = theirs["ttft_ms_p50"] / ours["batch"]["ttft_ms_p50"]
        verdicts.update(
            {
                "b_throughput_vs_continuous": ratio,
                "b_throughput_target_met": ratio >= TARGET_THROUGHPUT_RATIO,
                "b_ttft_p50_theirs_over_ours": ttft_ratio,
                "b_ttft_target_met": ttft_ratio >= TARGET_TTFT_RATIO,
            }
        )
        gen = report["transformers_generate"]
        verdicts["identical_outputs"] = {
            "inlinelm_vs_generate_single": ours["single"]["tokens"] == gen["single"]["tokens"],
            "inlinelm_vs_generate_batch": identical(
                ours["batch"]["tokens"], gen["batch"]["tokens"]
            ),
            "inlinelm_vs_continuous": identical(ours["batch"]["tokens"], theirs["tokens"]),
            "generate_vs_continuous": identical(gen["batch"]["tokens"], theirs["tokens"]),
            "of": len(ours["batch"]["tokens"]),
        }
    report["verdicts"] = verdicts


def _without_tokens(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _without_tokens(v) for k, v in value.items() if k not in ("tokens", "timestamps")
        }
    return value


def print_table(report: dict[str, Any]) -> None:
    n, r = report["new_tokens"], report["requests"]
    weights = "quantized" if report.get("quantization") == "auto" else "fp32"
    print(
        f"\n(a) one request, {n} new tokens, inlinelm {weights} (transformers fp32), "
        f"load average {report['load_average']}"
    )
    print(f"{'system':<32} {'TTFT ms':>9} {'ms/token':>9}  runs (ms/token)")
    rows = [("inlinelm", report["inlinelm"]["single"])]
    if "transformers_generate" in report:
        rows.append(("transformers generate", report["transformers_generate"]["single"]))
    for name, s in rows:
        runs = ", ".join(f"{x:.1f}" for x in s.get("runs_ms_per_token", []))
        print(f"{name:<32} {s['ttft_ms']:>9.1f} {s['ms_per_token']:>9.2f}  {runs}")
    print(f"\n(b) {r} concurrent requests, mixed prompt lengths, {n} new tokens each")
    print(f"{'system':<32} {'tokens/s':>9} {'wall s':>7} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}")
    rows = [("inlinelm", report["inlinelm"]["batch"])]
    if "transformers_generate" in report:
        rows.append(("transformers generate (static)", report["transformers_generate"]["batch"]))
        rows.append(
            ("transformers continuous batching", report["transformers_continuous"]["batch"])
        )
    for name, b in rows:
        print(
            f"{name:<32} {b['output_tokens_per_s']:>9.1f} {b['wall_s']:>7.2f} "
            f"{b['ttft_ms_p50']:>11.1f} {b['ttft_ms_p99']:>11.1f}"
        )
    v = report["verdicts"]
    print(
        f"\ntargets: (a) {v['a_ms_per_token']:.2f} ms/token vs <= {TARGET_MS_PER_TOKEN} "
        f"({'met' if v['a_target_met'] else 'MISSED'})"
    )
    if "b_throughput_vs_continuous" in v:
        print(
            f"         (b) throughput {v['b_throughput_vs_continuous']:.2f}x continuous batching vs >= "
            f"{TARGET_THROUGHPUT_RATIO}x ({'met' if v['b_throughput_target_met'] else 'MISSED'}); "
            f"TTFT p50 theirs/ours {v['b_ttft_p50_theirs_over_ours']:.2f} vs >= {TARGET_TTFT_RATIO} "
            f"({'met' if v['b_ttft_target_met'] else 'MISSED'})"
        )
        print(f"         identical greedy outputs: {v['identical_outputs']}")


def plot(report: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    systems = [("inlinelm", report["inlinelm"]["batch"])]
    if "transformers_generate" in report:
        systems += [
            ("generate\n(static)", report["transformers_generate"]["batch"]),
            ("continuous\nbatching", report["transformers_continuous"]["batch"]),
        ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [s[0] for s in systems]
    ax1.bar(names, [s[1]["output_tokens_per_s"] for s in systems], color="tab:blue")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"{report['requests']} concurrent requests, {report['new_tokens']} tokens")
    width = 0.35
    xs = range(len(systems))
    ax2.bar([x - width / 2 for x in xs], [s[1]["ttft_ms_p50"] for s in systems], width, label="p50")
    ax2.bar([x + width / 2 for x in xs], [s[1]["ttft_ms_p99"] for s in systems], width, label="p99")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("TTFT ms")
    ax2.set_title("time to first token")
    ax2.legend()
    save_plot(fig, "e2e_cpu.png")


if __name__ == "__main__":
    main()
