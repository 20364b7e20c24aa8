"""Per-step cost of structured output: filling the token bitmasks of B constrained rows
(llguidance) and applying them to ``[B, 49152]`` logits, beside the greedy sampling step
every row pays anyway. Median ms of ``--repeats`` runs at batch 1, 32 and 256.

Each row is a JSON-schema matcher inside a string value (a large allowed set) that takes
one more token before each fill ("consume + fill": the per-step grammar work), since a
matcher caches the mask of a state it has computed. Prints a table; ``--json PATH``
writes it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer

from _common import load_average, median, write_json
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.sampling.grammar_mask import GrammarMasks, apply_token_bitmask
from inlinelm.gpu.sampling.metadata import SamplingMetadata
from inlinelm.gpu.sampling.sampler import Sampler
from inlinelm.sampling_params import SamplingParams
from inlinelm.structured import StructuredOutput
from inlinelm.structured.compiler import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PREFIX = '{"name": "'
# Fed one token per repeat, so every fill computes the mask of a new state.
VALUE = "Ada Lovelace wrote the first program for the Analytical Engine in 1843. " * 8


def timed(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def measure(
    batch: int, compiled: Any, tokenizer: Any, device: torch.device, repeats: int
) -> dict[str, Any]:
    """Median ms of a greedy sampling step, of consume + fill, and of applying the mask."""
    vocab = 49152
    prefix = tokenizer.encode(PREFIX)
    matchers = []
    for _ in range(batch):
        matcher = compiled.new_matcher()
        for token in prefix:
            assert matcher.accept(token)
        matchers.append(matcher)
    logits = torch.randn(batch, vocab, device=device)
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=0.0)] * batch,
        [[0]] * batch,
        [[0]] * batch,
        [None] * batch,
        vocab_size=vocab,
        device=device,
    )
    sampler = Sampler()
    masks = GrammarMasks(batch, device)
    host = torch.empty((batch, -(-vocab // 32)), dtype=torch.int32)
    value = iter(tokenizer.encode(VALUE))

    def consume_and_fill() -> None:
        token = next(value)
        for matcher in matchers:
            matcher.accept(token)
        masks._fill(host, matchers)

    mask = torch.full((batch, host.shape[1]), 0x5555, dtype=torch.int32, device=device)
    sample_ms = timed(lambda: sampler(logits.clone(), meta), repeats, device)
    fill_ms = timed(consume_and_fill, repeats, device)
    apply_ms = timed(lambda: apply_token_bitmask(logits.clone(), mask), repeats, device)
    return {
        "batch": batch,
        "sample_ms": sample_ms,
        "fill_ms": fill_ms,
        "apply_ms": apply_ms,
        "mask_over_sample": (fill_ms + apply_ms) / sample_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    import llguidance.hf

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("default").folder))
    compiler = GrammarCompiler(lambda: llguidance.hf.from_tokenizer(tokenizer), 4)
    compiled = compiler.compile(StructuredOutput.json_schema(SCHEMA))
    vocab = 49152
    rows: list[dict[str, Any]] = []
    print(f"device {device}, vocab {vocab}, load average {load_average()}")
    print(
        f"{'batch':>5} {'sample ms':>10} {'consume+fill ms':>16} {'apply ms':>9} {'mask/sample':>12}"
    )
    for batch in args.batches:
        row = measure(batch, compiled, tokenizer, device, args.repeats)
        rows.append(row)
        print(
            f"{batch:>5} {row['sample_ms']:>10.3f} {row['fill_ms']:>16.3f} "
            f"{row['apply_ms']:>9.3f} {row['mask_over_sample']:>12.2f}"
        )
    write_json(args.json, {"device": str(device), "load_average": load_average(), "rows": rows})


if __name__ == "__main__":
    main()
