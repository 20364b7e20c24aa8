"""One sparse MoE MLP per decode step on this CPU: our :class:`SparseMoE` against
transformers' own block, side by side in one run.

Float32, random weights, 2 threads, one layer at 1 and 32 tokens (a decode step's rows),
for a Qwen3-MoE-like shape (hidden 1024, 8 experts top-2 of 512, no renormalising), a
Mixtral-like one (8 experts top-2 of 1408) and a fine-grained one (64 experts top-8 of
256, Qwen3-30B-A3B's routing density). Timed: ours as the loader leaves it (router packed
for oneDNN; the per-expert path), ours through the grouped path (torch's grouped GEMM has
a CPU kernel), and transformers' block with its eager experts (the reference loop) and
with ``grouped_mm`` (what ``from_pretrained`` picks). Each round runs every variant once,
in turn; medians over the rounds. Prints a table; ``--json PATH`` writes it and a PNG goes
to ``benchmarks/results/moe_step.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from _common import load_average, median, pyplot, save_plot, write_json
from inlinelm.gpu.model.config import MoEConfig
from inlinelm.gpu.model.kernels import TorchKernels
from inlinelm.gpu.model.layers.linear import onednn_packing_available
from inlinelm.gpu.model.layers.moe import SparseMoE

HIDDEN = 1024


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    intermediate: int
    renormalize: bool


SHAPES = [
    Shape("qwen3_moe-like", 8, 2, 512, False),
    Shape("mixtral-like", 8, 2, 1408, True),
    Shape("fine-grained", 64, 8, 256, True),
]
VARIANTS = ("ours", "ours grouped", "hf eager", "hf grouped_mm")


def reference_block(shape: Shape, implementation: str) -> Any:
    """transformers' Qwen3-MoE block (Mixtral's computes the same) with random weights."""
    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=shape.intermediate,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=shape.renormalize,
    )
    cfg._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn_like(param) * HIDDEN**-0.5)
    return block.eval()


def ours_from(block: Any, shape: Shape) -> SparseMoE:
    moe = MoEConfig(shape.experts, shape.top_k, shape.intermediate, shape.renormalize)
    ours = SparseMoE(HIDDEN, moe, TorchKernels())
    views = ours.expert_weights()
    inter = shape.intermediate
    with torch.no_grad():
        ours.gate.weight_t.copy_(block.gate.weight.t())
        for e in range(shape.experts):
            gate_up = block.experts.gate_up_proj[e]
            views[f"experts.{e}.gate_proj.weight"].copy_(gate_up[:inter])
            views[f"experts.{e}.up_proj.weight"].copy_(gate_up[inter:])
            views[f"experts.{e}.down_proj.weight"].copy_(block.experts.down_proj[e])
    if onednn_packing_available(torch.device("cpu"), torch.float32):
        ours.gate.pack_for_onednn()
    return ours.eval()


def variants(shape: Shape) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    # NOTE: one transformers block serves both of its variants (the experts read the
    # implementation from the config on every call), so only two copies of the weights
    # compete for the caches.
    block = reference_block(shape, "eager")
    ours = ours_from(block, shape)

    def hf(implementation: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            block.experts.config._experts_implementation = implementation
            out: torch.Tensor = block(x.unsqueeze(0))[0]
            return out

        return run

    return {
        "ours": ours,
        "ours grouped": ours.forward_grouped,
        "hf eager": hf("eager"),
        "hf grouped_mm": hf("grouped_mm"),
    }


def measure(shape: Shape, tokens: int, rounds: int, budget_s: float) -> dict[str, Any]:
    """Median µs per call of every variant (each round about ``budget_s`` of calls per
    variant), and how far their outputs are from transformers' eager one."""
    torch.manual_seed(tokens)
    fns = variants(shape)
    x = torch.randn(tokens, HIDDEN)
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        outs = {name: fn(x) for name, fn in fns.items()}  # also the warm-up
        calls = {name: _calls_in(fn, x, budget_s) for name, fn in fns.items()}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(calls[name]):
                    fn(x)
                times[name].append((time.perf_counter() - start) / calls[name] * 1e6)
    want = outs["hf eager"]
    err = max((out - want).abs().max().item() for out in outs.values())
    us = {name: median(t) for name, t in times.items()}
    return {
        "shape": shape.name,
        "experts": shape.experts,
        "top_k": shape.top_k,
        "intermediate": shape.intermediate,
        "tokens": tokens,
        "us": us,
        "hf_eager_over_ours": us["hf eager"] / us["ours"],
        "hf_grouped_mm_over_ours": us["hf grouped_mm"] / us["ours"],
        "ours_grouped_over_ours": us["ours grouped"] / us["ours"],
        "max_abs_diff": err,
    }


def _calls_in(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, budget_s: float) -> int:
    """Calls of ``fn`` that fill ``budget_s``, from the fastest of three (a slow first
    call, e.g. page faults on fresh weights, would leave one call per round)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return max(3, min(50, round(budget_s / best)))


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['shape']}\n{r['tokens']} tok" for r in rows]
    width = 0.2
    for i, name in enumerate(VARIANTS):
        ax.bar(
            [j + (i - 1.5) * width for j in range(len(rows))],
            [r["us"][name] / 1e3 for r in rows],
            width,
            label=name,
        )
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms per layer call")
    ax.set_title(f"one MoE layer, float32, {torch.get_num_threads()} threads")
    ax.legend(fontsize=8)
    save_plot(fig, "moe_step.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per variant per round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load average {load_average()}")
    header = " ".join(f"{name + ' µs':>16}" for name in VARIANTS)
    print(f"{'shape':>15} {'tok':>4} {header} {'eager/ours':>10} {'gmm/ours':>9} {'max diff':>9}")
    rows = []
    for shape in SHAPES:
        for tokens in (1, 32):
            row = measure(shape, tokens, args.rounds, args.budget)
            rows.append(row)
            cells = " ".join(f"{row['us'][name]:>16.0f}" for name in VARIANTS)
            print(
                f"{shape.name:>15} {tokens:>4} {cells} {row['hf_eager_over_ours']:>10.2f} "
                f"{row['hf_grouped_mm_over_ours']:>9.2f} {row['max_abs_diff']:>9.1e}"
            )
    plot(rows)
    write_json(args.json, {"threads": args.threads, "load_average": load_average(), "rows": rows})


if __name__ == "__main__":
    main()
