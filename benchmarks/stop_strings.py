"""Stop strings on the event loop: µs per streamed token, and the stop table's build cost.

Streams, in this thread's CPU µs per token (median and best of ``--repeats``): ``--batch``
fast-path detokenizers, each fed one token of ANSWER (SmolLM2 tokenizer) per step, ``update``
+ ``next_output_text`` as the output processor drives them, for these stop sets:

* ``none``: no stop strings;
* ``4 short``: four that never match the answer but start with characters it has often
  (``\\n``, ``<``, `````), so matching and hold-back are exercised;
* ``16 x 1024 other``: sixteen stops of ``max_stop_string_chars`` (1024) characters of other
  text (words, spaces, punctuation: the matcher enters and leaves them all the time);
* ``16 x 1024 follow``: sixteen 1024-character stops that each follow one request's own text
  for 1023 characters and then differ: the worst case, the hold-back grows to 1023.

Then the table (``StopStrings``) for each set and for one 20,000-character stop (as with the
caps raised): the build time (median) and the memory it keeps and peaks at (tracemalloc).

Runs on whatever ``inlinelm`` is importable, so the code before a change is measured the same
way: ``PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/stop_strings.py``. When the
detokenizer takes a shared ``StopStrings`` (one per request) the streams get one per request
set; otherwise each detokenizer builds its own (as the old code did per choice).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from transformers import AutoTokenizer

import inlinelm.detok
from _common import answer_ids, load_average, pyplot, save_plot, write_json
from inlinelm.detok import FastIncrementalDetokenizer, StopStrings
from inlinelm.gpu.loading.model_files import resolve_model

SHORT = ["\n\nUser:", "</answer>", "```end", "<|im_end|>"]
OTHER = "the quick brown fox, jumps over: a lazy dog. Stop; (then) 'go' on! "
MAX_CHARS = 1024
SHARED = "StopMatcher" in inlinelm.detok.__all__  # a detokenizer takes a request's table


def stop_sets(texts: Sequence[str]) -> dict[str, list[str]]:
    """The stop sets, the ``follow`` one built from the requests' own streamed texts."""
    other = [(OTHER[i:] + OTHER * 20)[:MAX_CHARS] for i in range(16)]
    follow = [(t * 4)[: MAX_CHARS - 1] + "\u2603" for t in texts[:16]]
    return {"none": [], "4 short": SHORT, "16 x 1024 other": other, "16 x 1024 follow": follow}


def streamed_texts(backend: Any, prompt: list[int], ids: list[list[int]]) -> list[str]:
    """Each request's text as a detokenizer without stops streams it."""
    texts = []
    for request in ids:
        detok = FastIncrementalDetokenizer(backend, prompt)
        detok.update(request)
        texts.append(detok.next_output_text(True, False))
    return texts


def time_stream(backend: Any, prompt: list[int], ids: list[list[int]], stops: list[str]) -> float:
    """CPU seconds (this thread's: what the event loop would spend, less the time another
    process held the core) to stream every request, one token per step (detokenizers built
    beforehand)."""
    stop: Any = StopStrings(stops) if SHARED and stops else stops
    detoks = [FastIncrementalDetokenizer(backend, prompt, stop=stop) for _ in ids]
    start = time.thread_time()
    for step in range(len(ids[0])):
        for detok, request in zip(detoks, ids, strict=True):
            detok.update([request[step]])
            detok.next_output_text(False, True)
    elapsed = time.thread_time() - start
    assert all(d.stop_reason is None for d in detoks), "a stop string matched; the run is short"
    return elapsed


def time_build(stops: list[str], repeats: int) -> float:
    """Median µs to build the stop table."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        StopStrings(stops)
        runs.append((time.perf_counter() - start) * 1e6)
    return statistics.median(runs)


def traced_build(stops: list[str]) -> tuple[int, int]:
    """Bytes the stop table keeps and the peak while building it."""
    tracemalloc.start()
    table = StopStrings(stops)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del table
    return kept, peak


def measure(repeats: int, run: Callable[[], float]) -> tuple[float, float]:
    """Median and best of ``repeats`` runs (the best is the least disturbed by other load)."""
    runs = [run() for _ in range(repeats)]
    return statistics.median(runs), min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("default").folder))
    backend = tokenizer.backend_tokenizer
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    ids = answer_ids(tokenizer, args.batch, args.steps)
    sets = stop_sets(streamed_texts(backend, prompt, ids))
    big = ["".join(OTHER * 300)[:20000]]
    print(f"shared table: {SHARED}; load average {load_average()}")
    print(f"batch {args.batch}, {args.steps} steps, one token per step, median of {args.repeats}")
    head = ["µs/token", "best", "build µs", "kept KB", "peak KB"]
    print(f"{'stop set':<18}" + "".join(f" {h:>9}" for h in head))
    rows = []
    for name, stops in [*sets.items(), ("1 x 20000", big)]:
        row: dict[str, Any] = {"name": name}
        if name != "1 x 20000":
            tokens = args.batch * args.steps
            seconds, best = measure(
                args.repeats, lambda s=stops: time_stream(backend, prompt, ids, s)
            )
            row["us_per_token"] = seconds / tokens * 1e6
            row["best_us_per_token"] = best / tokens * 1e6
        if stops:
            row["build_us"] = time_build(stops, args.repeats)
            row["kept_bytes"], row["peak_bytes"] = traced_build(stops)
        rows.append(row)
        print(f"{name:<18}" + "".join(f" {v:>9.2f}" for v in table_values(row)))
    write_json(
        args.json, {"shared": SHARED, "batch": args.batch, "steps": args.steps, "rows": rows}
    )
    plot(rows)


def table_values(row: dict[str, Any]) -> list[float]:
    nan = float("nan")
    return [
        row.get("us_per_token", nan),
        row.get("best_us_per_token", nan),
        row.get("build_us", nan),
        row.get("kept_bytes", 0) / 1024,
        row.get("peak_bytes", 0) / 1024,
    ]


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    streamed = [r for r in rows if "us_per_token" in r]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["name"] for r in streamed], [r["us_per_token"] for r in streamed])
    ax.set_xlabel("µs per token (update + next_output_text)")
    save_plot(fig, "stop_strings.png")


if __name__ == "__main__":
    main()
