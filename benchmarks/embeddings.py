"""Embeddings per second on this CPU: ``Engine.embed`` against sentence-transformers, side
by side in one process.

The model is BERT-base-shaped with random weights (hidden 768, 12 layers, 12 heads,
intermediate 3,072, 512 positions; ~110 M parameters), built here and nothing downloaded:
a lowercasing WordPiece tokenizer of 30,522 entries made with the ``tokenizers`` library
(the pooling fixtures' specials, characters and word list, then made-up lowercase words),
the model from ``transformers.BertConfig`` / ``BertModel(config).save_pretrained`` under
seed 0, and the sentence-transformers files around it (``tests/pooling/builders.py``:
mean pooling, then ``Normalize``; ``max_seq_length`` 512), in a temporary folder. Both
sides load that folder in float32:

- ours: ``Engine(model=folder, num_threads=T, max_num_batched_tokens=N)`` (its task
  resolves to "embed"), ``await engine.embed(texts)``: one call with the whole batch; the
  scheduler cuts it into steps of at most N tokens (2,048, the default;
  ``--batched-tokens 2048 8192`` adds an engine per value);
- sentence-transformers: ``SentenceTransformer(folder, device="cpu").encode(texts,
  batch_size=32)``, as a user calls it (its default batch size: it sorts the texts by
  length and pads each batch of 32 to its longest; ``--st-batch-sizes`` adds others, but
  ``batch_size=len(texts)`` only pads more: 256 texts become one 256 x 64 block).

The texts are whole words of the vocabulary, so each is exactly its drawn number of tokens
([CLS] and [SEP] included): lengths log-uniform from ``--min-tokens`` to ``--max-tokens``
(8 to 64: many short inputs, a few long ones), seed 1. Every batch size takes the first
texts of that one list, the same texts for both sides. Batch 1 embeds ``--singles`` (16)
texts one call each (embeddings/s = their count / the time of all the calls); batch 32
and 256 make one call of that many texts.

Both sides get ``--threads`` (2) torch CPU threads: ``torch.set_num_threads`` here and the
engine's ``num_threads`` (its own rule would drop to 1 thread while other processes keep a
core busy); denormals are flushed on both threads (the engine flushes them on its own).
sentence-transformers runs on the event loop's thread while the engine's thread waits, so
the process holds two OpenMP teams (2 + 2 threads on 2 cores: libgomp spins less at its
barriers then, for both sides alike). Each side is warmed up first (a call of 1 text, one
of 32); then rounds alternate ours and theirs, every other round in reverse order (so the
load of other processes falls on both alike): ``--repeats`` (5) rounds at batch 1 and 32,
``--repeats-256`` (3) at batch 256. The table quotes the medians' embeddings/s, ours /
theirs, and in brackets the range of the rounds' own ratios (how much other processes
moved them). The vectors of the last round are compared (max abs difference): both sides
did the same work.

About 2.5 minutes on 2 cores with another ~1.5 cores of load (``--quick``: 3 rounds below
256, one at 256, about 1.5 minutes). Prints a table, ``--json PATH`` writes it, and a PNG
goes to ``benchmarks/results/embeddings.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' pooling builders

import torch

from _common import load_average, median, pyplot, save_plot, write_json

TARGET_RATIO_256 = 1.5
"""Ours / sentence-transformers embeddings per second at batch 256."""

VOCAB_SIZE = 30522
"""bert-base-uncased's vocabulary size."""

SHAPE: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
}
"""BERT-base (transformers' ``BertConfig`` defaults, spelled out)."""

MAX_SEQ_LENGTH = 512
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TEXT_SEED = 1
WARMUP_TEXTS = 32

# -- the model ------------------------------------------------------------------------------


def build_model(folder: Path) -> list[str]:
    """Write the tokenizer, the random-weight BERT-base and the sentence-transformers files
    into ``folder``; return the tokenizer's whole words (each one token)."""
    from tests.pooling import builders
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    known = set(builders.bert_tokenizer().get_vocab())
    extra: list[str] = []
    rng = random.Random(0)
    while len(known) < VOCAB_SIZE:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        if word not in known:
            known.add(word)
            extra.append(word)
    tok = builders.bert_tokenizer(extra)
    vocab = tok.get_vocab()
    pieces = sorted(vocab, key=vocab.__getitem__)
    names = ("pad", "unk", "cls", "sep", "mask")
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=MAX_SEQ_LENGTH,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        **{f"{n}_token": t for n, t in zip(names, SPECIALS, strict=True)},
    ).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), pad_token_id=vocab["[PAD]"], **SHAPE)
    BertModel(config).eval().save_pretrained(str(folder))
    builders.write_sentence_transformers(folder, "mean", SHAPE["hidden_size"], normalize=True)
    # NOTE: the builders' fixtures stop at 128 tokens; this model takes its 512.
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False}) + "\n"
    )
    return [p for p in pieces if p.isalpha() and p.islower()]


def make_texts(folder: Path, words: list[str], count: int, low: int, high: int) -> list[str]:
    """``count`` texts of log-uniform lengths in ``[low, high]`` tokens ([CLS] and [SEP]
    included), whole words drawn with a fixed seed; checked against the tokenizer."""
    from tokenizers import Tokenizer

    rng = random.Random(TEXT_SEED)
    lengths, texts = [], []
    for _ in range(count):
        lengths.append(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
        texts.append(" ".join(rng.choice(words) for _ in range(lengths[-1] - 2)))
    encoded = Tokenizer.from_file(str(folder / "tokenizer.json")).encode_batch(texts)
    assert [len(e.ids) for e in encoded] == lengths, "a text is not its drawn length"
    return texts


# -- the two sides --------------------------------------------------------------------------


class Ours:
    """One started engine per ``max_num_batched_tokens``."""

    def __init__(self, folder: Path, threads: int, batched_tokens: int) -> None:
        from inlinelm import Engine

        self.batched_tokens = batched_tokens
        self.engine = Engine(
            model=str(folder),
            num_threads=threads,
            max_num_batched_tokens=batched_tokens,
        )

    async def start(self) -> None:
        await self.engine.start()
        assert self.engine.task == "embed", self.engine.task

    async def embed(self, texts: list[str]) -> Any:
        return await self.engine.embed(texts)

    async def close(self) -> None:
        await self.engine.aclose()


class Theirs:
    def __init__(self, folder: Path) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(folder), device="cpu")

    def embed(self, texts: list[str], batch_size: int) -> Any:
        """``encode`` as a user calls it (a numpy array back)."""
        return self.model.encode(texts, batch_size=batch_size, show_progress_bar=False)


Side = Callable[[list[str]], Awaitable[Any]]


async def timed(
    side: Side, batch: int, texts: list[str], singles: int
) -> tuple[float, torch.Tensor]:
    """Seconds for ``batch`` (batch 1: ``singles`` texts, one call each) and the vectors
    (made a tensor after the clock stops)."""
    t0 = time.perf_counter()
    if batch == 1:
        results = [await side(texts[i : i + 1]) for i in range(singles)]
    else:
        results = [await side(texts[:batch])]
    seconds = time.perf_counter() - t0
    return seconds, torch.cat([as_tensor(r) for r in results])


def as_tensor(result: Any) -> torch.Tensor:
    """Ours (``EmbeddingOutput`` list) or theirs (numpy array) as a float32 tensor."""
    if isinstance(result, list):
        return torch.tensor([o.embedding for o in result], dtype=torch.float32)
    return torch.from_numpy(result).float()


# -- the run --------------------------------------------------------------------------------


async def run(folder: Path, texts: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    ours = {n: Ours(folder, args.threads, n) for n in args.batched_tokens}
    theirs = Theirs(folder)
    sides: dict[str, Side] = {}
    for n, engine in ours.items():
        await engine.start()
        sides[f"ours {n}"] = engine.embed
    for size in args.st_batch_sizes:

        async def st(batch: list[str], size: int = size) -> Any:
            return theirs.embed(batch, size)

        sides[f"st {size}"] = st
    rows = []
    try:
        # NOTE: warm-up: one text, then WARMUP_TEXTS in one call (no untimed batch of 256:
        # it would cost a round; the first round's new shapes are one of three medians).
        for side in sides.values():
            await side(texts[:1])
            await side(texts[:WARMUP_TEXTS])
        for batch in args.batches:
            repeats = args.repeats_256 if batch >= 256 else args.repeats
            times: dict[str, list[float]] = {name: [] for name in sides}
            vectors: dict[str, torch.Tensor] = {}
            for round_ in range(repeats):
                # NOTE: every other round in reverse (ABBA), so a drift of the load does
                # not favour the side that always runs first.
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for name in order:
                    seconds, vectors[name] = await timed(sides[name], batch, texts, args.singles)
                    times[name].append(seconds)
            rows.append(summarise(batch, args.singles, texts, times, vectors))
            print_row(rows[-1], list(sides))
    finally:
        for engine in ours.values():
            await engine.close()
    return rows


def summarise(
    batch: int,
    singles: int,
    texts: list[str],
    times: dict[str, list[float]],
    vectors: dict[str, torch.Tensor],
) -> dict[str, Any]:
    count = singles if batch == 1 else batch
    tokens = sum(len(t.split()) + 2 for t in texts[:count])
    per_s = {name: count / median(ts) for name, ts in times.items()}
    names = list(times)
    ours_names = [n for n in names if n.startswith("ours")]
    st_names = [n for n in names if n.startswith("st")]
    reference = vectors[st_names[0]]
    ratios, paired = {}, {}
    for o in ours_names:
        for s in st_names:
            ratios[f"{o} / {s}"] = per_s[o] / per_s[s]
            # NOTE: each round's own ratio (the two calls ran back to back): its spread
            # shows how much the load of other processes moved the medians.
            paired[f"{o} / {s}"] = [b / a for a, b in zip(times[o], times[s], strict=True)]
    return {
        "batch": batch,
        "embeddings": count,
        "tokens": tokens,
        "embeddings_per_s": per_s,
        "seconds": times,
        "ours_over_st": ratios,
        "ours_over_st_per_round": paired,
        "max_abs_diff": {name: (v - reference).abs().max().item() for name, v in vectors.items()},
    }


def header(names: list[str]) -> str:
    ours = [n for n in names if n.startswith("ours")]
    st = [n for n in names if n.startswith("st")]
    cols = [f"{n + ' emb/s':>14}" for n in names]
    ratios = [f"{f'{o[5:]}/{s[3:]} (rounds)':>20}" for o in ours for s in st]
    return f"{'batch':>5} {'tokens':>6} " + " ".join(cols) + " " + " ".join(ratios) + "  max |diff|"


def print_row(r: dict[str, Any], names: list[str]) -> None:
    cols = [f"{r['embeddings_per_s'][n]:>14.1f}" for n in names]
    ratios = [
        f"{f'{v:.2f} ({min(rounds):.2f}-{max(rounds):.2f})':>20}"
        for v, rounds in zip(
            r["ours_over_st"].values(), r["ours_over_st_per_round"].values(), strict=True
        )
    ]
    diff = max(r["max_abs_diff"].values())
    print(
        f"{r['batch']:>5} {r['tokens']:>6} "
        + " ".join(cols)
        + " "
        + " ".join(ratios)
        + f"  {diff:.1e}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], names: list[str], threads: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(
            [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))],
            [r["embeddings_per_s"][name] for r in rows],
            width,
            label=name.replace("ours", "inlinelm, batched tokens").replace(
                "st", "sentence-transformers, batch_size"
            ),
        )
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("embeddings / s")
    ax.set_ylim(top=1.3 * max(max(r["embeddings_per_s"].values()) for r in rows))
    ax.set_title(f"BERT-base (random weights), float32, {threads} threads")
    ax.legend(fontsize=8)
    save_plot(fig, "embeddings.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--singles", type=int, default=16, help="texts timed at batch 1")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="rounds at batch 1 and 32")
    parser.add_argument("--repeats-256", type=int, default=3, help="rounds at batch 256")
    parser.add_argument(
        "--batched-tokens",
        type=int,
        nargs="+",
        default=[2048],
        help="ours: max_num_batched_tokens, one engine each",
    )
    parser.add_argument(
        "--st-batch-sizes",
        type=int,
        nargs="+",
        default=[32],
        help="sentence-transformers: encode's batch_size, each a side of its own",
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds below 256, 1 at 256")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.repeats_256 = 3, 1
    assert 3 <= args.min_tokens <= args.max_tokens <= MAX_SEQ_LENGTH
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers
    before = load_average()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="embeddings-bert-base-") as tmp:
        folder = Path(tmp)
        words = build_model(folder)
        count = max(*args.batches, args.singles)
        texts = make_texts(folder, words, count, args.min_tokens, args.max_tokens)
        names = [f"ours {n}" for n in args.batched_tokens] + [
            f"st {s}" for s in args.st_batch_sizes
        ]
        print(
            f"torch {torch.__version__}, {args.threads} threads, BERT-base float32, texts of "
            f"{args.min_tokens}-{args.max_tokens} tokens (log-uniform); medians of "
            f"{args.repeats} rounds ({args.repeats_256} at 256); load average {before}"
        )
        print("ours N: Engine.embed with max_num_batched_tokens N; st S: encode(batch_size=S)")
        print(header(names))
        rows = asyncio.run(run(folder, texts, args))
    took = time.perf_counter() - start
    after = load_average()
    print(f"{took:.0f} s; load average {after}")
    big = [r for r in rows if r["batch"] >= 256]
    if big:
        best = max(big[-1]["ours_over_st"].values())
        verdict = "met" if best >= TARGET_RATIO_256 else "not met"
        print(
            f"batch {big[-1]['batch']}: ours / st {best:.2f}, target >= {TARGET_RATIO_256} ({verdict})"
        )
    plot(rows, names, args.threads)
    write_json(
        args.json,
        {
            "threads": args.threads,
            "shape": {**SHAPE, "vocab_size": VOCAB_SIZE},
            "min_tokens": args.min_tokens,
            "max_tokens": args.max_tokens,
            "singles": args.singles,
            "repeats": args.repeats,
            "repeats_256": args.repeats_256,
            "batched_tokens": args.batched_tokens,
            "st_batch_sizes": args.st_batch_sizes,
            "target_ratio_256": TARGET_RATIO_256,
            "load_average_before": before,
            "load_average_after": after,
            "seconds": took,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
