"""Frontend cost of detokenization: µs per token of ``update`` + ``next_output_text``.

Batch 256: 256 detokenizers, each fed one token per step for 128 steps, the way the output
processor drives them. The ids come from a realistic chat answer (markdown, code, emoji, CJK),
each request starting at a different offset. Rows: the fast (DecodeStream) and slow (token
strings) paths, with and without stop strings, the bare ``DecodeStream.step`` floor, and a long
answer (2048 steps, batch 32) to show that the cost per token does not grow with the output.
Prints a table; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from _common import ANSWER, STOPS
from inlinelm.detok import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    make_detokenizer,
)
from inlinelm.gpu.loading.model_files import resolve_model

PROMPT = "<|im_start|>user\nHow do I sort a list in Python?<|im_end|>\n<|im_start|>assistant\n"

Factory = Callable[[list[int]], Any]


def request_ids(tokenizer: Any, batch: int, steps: int) -> list[list[int]]:
    """One id list per request: the answer, repeated to length, from a per-request offset."""
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    looped = ids * (2 + steps // len(ids))
    return [looped[(i * 7) % len(ids) :][:steps] for i in range(batch)]


def time_detokenizers(make: Factory, prompt: list[int], ids: list[list[int]]) -> float:
    """Seconds for every step of every request: update + next_output_text."""
    detoks: list[IncrementalDetokenizer] = [make(prompt) for _ in ids]
    steps = len(ids[0])
    start = time.perf_counter()
    for step in range(steps):
        for detok, request in zip(detoks, ids, strict=True):
            detok.update([request[step]])
            detok.next_output_text(False, True)
    elapsed = time.perf_counter() - start
    assert all(d.stop_reason is None for d in detoks), "a stop string hit; the run is short"
    return elapsed


def time_decode_stream(backend: Any, prompt: list[int], ids: list[list[int]]) -> float:
    """Seconds for the bare DecodeStream.step floor, primed like the fast path."""
    streams = [DecodeStream(ids=prompt[-4:], skip_special_tokens=True) for _ in ids]
    steps = len(ids[0])
    start = time.perf_counter()
    for step in range(steps):
        for stream, request in zip(streams, ids, strict=True):
            stream.step(backend, request[step])
    return time.perf_counter() - start


def time_construction(tokenizer: Any, prompt: list[int], count: int = 2000) -> dict[str, Any]:
    """µs per request for make_detokenizer with stop strings (once per request, not per token)."""
    start = time.perf_counter()
    for _ in range(count):
        make_detokenizer(tokenizer, prompt, stop=STOPS)
    us = (time.perf_counter() - start) / count * 1e6
    return {"name": "make_detokenizer, µs per request", "us_per_token": us, "best_us": us}


def measure(name: str, run: Callable[[], float], tokens: int, repeats: int) -> dict[str, Any]:
    """The median of ``repeats`` runs, in µs per token."""
    runs = [run() / tokens * 1e6 for _ in range(repeats)]
    return {"name": name, "us_per_token": statistics.median(runs), "best_us": min(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("default").folder))
    backend = tokenizer.backend_tokenizer
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    ids = request_ids(tokenizer, args.batch, args.steps)
    long_ids = request_ids(tokenizer, 32, 2048)
    paths: dict[str, Factory] = {
        "fast": lambda p: FastIncrementalDetokenizer(backend, p),
        "fast + stop strings": lambda p: FastIncrementalDetokenizer(backend, p, stop=STOPS),
        "slow": lambda p: SlowIncrementalDetokenizer(tokenizer, p),
        "slow + stop strings": lambda p: SlowIncrementalDetokenizer(tokenizer, p, stop=STOPS),
    }
    tokens = args.batch * args.steps
    floor = partial(time_decode_stream, backend, prompt, ids)
    rows = [measure("DecodeStream.step floor", floor, tokens, args.repeats)]
    for name, make in paths.items():
        run = partial(time_detokenizers, make, prompt, ids)
        rows.append(measure(name, run, tokens, args.repeats))
    for name in ("fast + stop strings", "slow + stop strings"):
        run = partial(time_detokenizers, paths[name], prompt, long_ids)
        rows.append(measure(f"{name}, 2048 steps x 32", run, 32 * 2048, 1))
    rows.append(time_construction(tokenizer, prompt))

    print(f"batch {args.batch}, {args.steps} steps, one token per step, median of {args.repeats}")
    print(f"{'path':<38} {'µs/token':>9} {'best':>7}")
    for row in rows:
        print(f"{row['name']:<38} {row['us_per_token']:>9.2f} {row['best_us']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "steps": args.steps, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
