"""One decode step of every model family on this CPU: our model runner against
transformers' own model, side by side in one run.

For each family in :data:`~inlinelm.gpu.model.registry.FAMILIES`, transformers builds a
small model with random weights (:data:`SHAPES`: hidden 512, 4 layers, the default
tokenizer's vocab of 49,152 with tied embeddings, the family's head dim, 8 experts top-2
for the MoE families, Gemma's head dim 256, soft caps and local/global layers) and saves it
beside the default tokenizer in a temporary folder. Both systems then hold that model in
float32 with 2 threads:

- ours: :class:`~inlinelm.gpu.model_runner.ModelRunner` loads the folder and the real
  :class:`~inlinelm.sched.scheduler.Scheduler` feeds it, as ``decode_steps.py`` does; each
  sequence's prompt of ``--context`` random tokens (256) is prefilled in chunks of 2,048
  tokens (the sequences done first decode a few tokens while the others' chunks run),
  then the decode steps are timed: ``runner.execute`` (inputs, the forward over the paged
  KV cache, greedy sampling, the ids back on the host);
- theirs: the model transformers built, a ``DynamicCache`` prefilled with the same prompts
  in one call, then ``model(next_ids, cache=cache)`` and the argmax of its
  logits per step, with the attention (and experts) implementation transformers picks
  by default (sdpa; eager for Gemma 2's soft caps; grouped_mm experts).

Each decode step of ours is followed by one of theirs (so load from other processes falls
on both alike), ``--warmup`` steps each first; medians of ``--repeats`` steps, at batch 1
and 32. The windows are 128, shorter than the context, so windowed layers do cut (the
families' real windows, 4,096 for Mistral and Gemma 2 and 512 for Gemma 3, would not at
this length). About 1.5 minutes on 2 idle cores. Prints ms per step and theirs / ours per family; ``--json PATH`` writes
them and a PNG goes to ``benchmarks/results/family_step.png``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

from _common import load_average, median, pyplot, save_plot, write_json
from inlinelm.config import EngineConfig
from inlinelm.gpu.model.registry import FAMILIES
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.output import SchedulerOutput
from inlinelm.sched.request import Request
from inlinelm.sched.scheduler import Scheduler

TOKENIZER_DIR = Path(__file__).resolve().parent / "gpu_assets"
"""The default model's tokenizer (and config), shipped in the tree."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

WINDOW = 128
BATCHES = (1, 32)
SPARE_TOKENS = 16
"""Tokens each sequence may generate past the timed steps: the sequences prefilled first
decode while the chunks of the others' prompts run."""
EOS = 2

BASE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": EOS,
}
"""What every family's config shares: about SmolLM2-135M's width (512 of its 576) and 4 of
its 30 layers, so twelve families fit in about 1.5 minutes."""

_GEMMA = {
    "num_attention_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": WINDOW,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "qwen3_moe": {
        "head_dim": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 768,
        "sliding_window": None,
    },
    "gemma2": {**_GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # NOTE: 6 layers: Gemma 3's pattern of five local layers to one global one.
    "gemma3_text": {**_GEMMA, "num_hidden_layers": 6, "num_key_value_heads": 1},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 8.0,
    },
    "smollm3": {"no_rope_layer_interval": 4, "pad_token_id": 0},
}
"""Overrides of :data:`BASE` by ``model_type``, one per family."""


def family_model_types() -> list[str]:
    """The first ``model_type`` of every registered family, in the registry's order."""
    return [family.model_types[0] for family in FAMILIES]


def build_theirs(model_type: str, folder: Path) -> Any:
    """transformers' model of ``model_type`` with random weights, saved in ``folder`` with
    the default tokenizer's files."""
    options = {**BASE, **SHAPES[model_type]}
    config = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(0)
    # the auto class is untyped in transformers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.eval()
    model.save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copy(TOKENIZER_DIR / name, folder / name)
    return model


def prompts(batch: int, context: int, vocab: int, seed: int) -> torch.Tensor:
    """``batch`` distinct prompts of ``context`` random ids (no prefix-cache hits)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, context), generator=generator)


class OursDecode:
    """Our runner fed by the real scheduler: prefill on construction, one decode per step."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, ids: torch.Tensor, steps: int):
        self.runner, self.scheduler, self.batch = runner, scheduler, len(ids)
        params = SamplingParams(temperature=0.0, max_tokens=steps + SPARE_TOKENS, ignore_eos=True)
        self.request_ids = [f"b{len(ids)}-{i}" for i in range(len(ids))]
        for request_id, row in zip(self.request_ids, ids.tolist(), strict=True):
            scheduler.add_request(Request(request_id, row, params, EOS))
        while not self._decoding():
            self._run()

    def _decoding(self) -> bool:
        running = self.scheduler.running
        return not self.scheduler.waiting and all(r.num_output_tokens > 0 for r in running)

    def _run(self) -> tuple[float, SchedulerOutput]:
        out = self.scheduler.schedule()
        start = time.perf_counter()
        result = self.runner.execute(out)
        elapsed = time.perf_counter() - start
        self.scheduler.update_from_output(out, result)
        return elapsed, out

    def step(self) -> float:
        """One decode step of every sequence; seconds in ``runner.execute``."""
        elapsed, out = self._run()
        assert len(out.scheduled) == self.batch, "a sequence was preempted or finished"
        assert all(item.num_tokens == 1 for item in out.scheduled)
        return elapsed

    def finish(self) -> None:
        """Abort the sequences: the next batch's first step frees their rows and blocks."""
        self.scheduler.abort_requests(self.request_ids)


class TheirsDecode:
    """transformers' model over a ``DynamicCache``: prefill on construction, then one
    decode per step with the greedy token of the one before."""

    def __init__(self, model: Any, ids: torch.Tensor):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids, cache=self.cache, logits_to_keep=1)
        self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step(self) -> float:
        start = time.perf_counter()
        out = self.model(input_ids=self.next_ids, cache=self.cache)
        self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start


def interleave(
    ours: Callable[[], float], theirs: Callable[[], float], warmup: int, repeats: int
) -> tuple[list[float], list[float]]:
    """``warmup`` untimed steps of each, then ``repeats`` pairs, ours first in each pair."""
    for _ in range(warmup):
        ours()
        theirs()
    pairs = [(ours(), theirs()) for _ in range(repeats)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def ours_runner(folder: Path, threads: int, context: int, steps: int) -> ModelRunner:
    blocks = max(BATCHES) * (-(-(context + steps + SPARE_TOKENS) // 16)) + 16
    config = EngineConfig(
        model=str(folder),
        num_threads=threads,
        max_model_len=1024,
        max_num_batched_tokens=2048,
        num_kv_blocks=blocks,
    )
    runner = ModelRunner(config, folder)
    runner.warmup()
    return runner


def measure(model_type: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """ms per decode step of ours and theirs for ``model_type`` at every batch size."""
    steps = args.warmup + args.repeats
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"family-{model_type}-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        theirs_model = build_theirs(model_type, folder)
        runner = ours_runner(folder, args.threads, args.context, steps)
        scheduler = Scheduler(runner.config, runner.num_kv_blocks, EOS)
        built_s = time.perf_counter() - t0
        for batch in BATCHES:
            ids = prompts(batch, args.context, BASE["vocab_size"], seed=batch)
            t1 = time.perf_counter()
            ours = OursDecode(runner, scheduler, ids, steps)
            theirs = TheirsDecode(theirs_model, ids)
            prefill_s = time.perf_counter() - t1
            ours_s, theirs_s = interleave(ours.step, theirs.step, args.warmup, args.repeats)
            ours.finish()
            rows.append(row(model_type, theirs_model, batch, ours_s, theirs_s, built_s, prefill_s))
            print_row(rows[-1])
            del theirs
        runner.close()
        del theirs_model, runner
        gc.collect()
    return rows


def row(
    model_type: str,
    model: Any,
    batch: int,
    ours_s: list[float],
    theirs_s: list[float],
    built_s: float,
    prefill_s: float,
) -> dict[str, Any]:
    cfg = model.config
    ours_ms, theirs_ms = median(ours_s) * 1e3, median(theirs_s) * 1e3
    return {
        "family": model_type,
        "batch": batch,
        "ours_ms": ours_ms,
        "theirs_ms": theirs_ms,
        "theirs_over_ours": theirs_ms / ours_ms,
        "ours_ms_steps": [t * 1e3 for t in ours_s],
        "theirs_ms_steps": [t * 1e3 for t in theirs_s],
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "layers": cfg.num_hidden_layers,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}",
        "attn_implementation": cfg._attn_implementation,
        "experts_implementation": getattr(cfg, "_experts_implementation", None),
        "build_load_s": built_s,
        "prefill_both_s": prefill_s,
    }


HEADER = (
    f"{'family':>12} {'B':>3} {'params M':>8} {'hd':>4} {'heads':>5} {'hf attn':>7} "
    f"{'ours ms':>8} {'hf ms':>8} {'hf/ours':>7}"
)


def print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['family']:>12} {r['batch']:>3} {r['params_m']:>8.1f} {r['head_dim']:>4} "
        f"{r['heads']:>5} {r['attn_implementation']:>7} {r['ours_ms']:>8.2f} "
        f"{r['theirs_ms']:>8.2f} {r['theirs_over_ours']:>7.2f}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for i, batch in enumerate(BATCHES):
        ratio = {r["family"]: r["theirs_over_ours"] for r in rows if r["batch"] == batch}
        ax.bar(
            [j + (i - 0.5) * width for j in range(len(families))],
            [ratio.get(f, float("nan")) for f in families],
            width,
            label=f"batch {batch}",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(families)), families, fontsize=8, rotation=30)
    ax.set_ylabel("transformers ms / ours ms")
    ax.set_title(f"decode step per family, float32, {torch.get_num_threads()} threads")
    ax.legend(fontsize=8)
    save_plot(fig, "family_step.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--families", nargs="+", choices=family_model_types())
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers
    before = load_average()
    start = time.perf_counter()
    print(
        f"torch {torch.__version__}, {args.threads} threads, context {args.context}, "
        f"median of {args.repeats} after {args.warmup}; load average {before}"
    )
    print(HEADER)
    rows = []
    for model_type in args.families or family_model_types():
        rows.extend(measure(model_type, args))
    took = time.perf_counter() - start
    after = load_average()
    print(f"{took:.0f} s; load average {after}")
    plot(rows)
    write_json(
        args.json,
        {
            "threads": args.threads,
            "context": args.context,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "base_config": BASE,
            "shapes": SHAPES,
            "load_average_before": before,
            "load_average_after": after,
            "seconds": took,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
