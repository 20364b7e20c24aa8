"""Shared pieces of the benchmarks: realistic text, chat prompts, statistics, output files."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

ANSWER = """\
## Sorting in Python 🐍

Sure! Here is a **quick** overview. Python's `sorted()` returns a *new* list, while
`list.sort()` sorts in place and returns `None`:

```python
def top_k(items: list[int], k: int = 3) -> list[int]:
    # largest first
    return sorted(items, reverse=True)[:k]

print(top_k([5, 1, 4, 2, 3]))  # → [5, 4, 3]
```

| method | in place | returns |
| --- | --- | --- |
| `list.sort()` | yes | `None` |
| `sorted()` | no | a new list |

1. Use `key=` for custom orders, e.g. `sorted(words, key=str.lower)`.
2. Sorting is *stable*: equal items keep their order.

In Chinese: 排序算法很有用。日本語では「並べ替え」と言います。 Happy coding! 👨‍💻🎉👍🏽
"""
"""A chat answer with markdown, code, a table, emoji (ZWJ and skin tone) and CJK."""

STOPS = ["\n\nUser:", "</answer>", "```end"]
"""Stop strings that never match ANSWER but share prefixes with it (hold-back is exercised)."""

QUESTIONS = [
    "How do I sort a list in Python?",
    "Explain the difference between a process and a thread, with an example.",
    "Write a haiku about autumn rain in Kyoto.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "Give me three tips for writing readable SQL queries.",
    "请用中文解释一下什么是机器学习。",
    "Summarise the plot of Hamlet in two sentences. 🎭",
    "How can I reverse a linked list in C? Show the code.",
]


def chat_messages(i: int) -> list[dict[str, str]]:
    """A realistic chat for request ``i``: a system prompt and one of several questions."""
    system = "You are a helpful assistant. Answer concisely and use markdown where it helps."
    question = QUESTIONS[i % len(QUESTIONS)]
    if i % 3 == 1:
        question += " Please be thorough and give examples." * (1 + i % 4)
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def quality_prompts(tokenizer: Any, count: int = 32) -> list[list[int]]:
    """Issue 24's quality prompts: ``count`` varied chat prompts (a question, every other
    one after a context of growing length), as token ids with the generation prompt."""
    words = ANSWER.split()
    prompts = []
    for i in range(count):
        context = " ".join(words[(i * 7) % len(words) :][: 5 + i * 3])
        question = QUESTIONS[i % len(QUESTIONS)]
        content = f"{context}\n\n{question}" if i % 2 else question
        prompts.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return prompts


def answer_ids(tokenizer: Any, batch: int, steps: int) -> list[list[int]]:
    """One id list per request: ANSWER repeated to ``steps`` tokens, from a per-request offset."""
    ids = list(tokenizer.encode(ANSWER, add_special_tokens=False))
    looped = ids * (2 + steps // len(ids))
    return [looped[(i * 7) % len(ids) :][:steps] for i in range(batch)]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` shows them."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), **payload}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def save_plot(fig: Any, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


@contextmanager
def workers(
    targets: dict[str, tuple[Callable[..., None], tuple[Any, ...]]],
) -> Iterator[dict[str, Any]]:
    """One spawned process per name, ``target(*args, conn)``, each answering jobs over its
    end of a pipe until it receives None (sent to every worker on exit, then joined).
    Engines are measured each in a process of its own: two in one process run two OpenMP
    thread teams, and GNU OpenMP then stops spinning (slower steps for both)."""
    context = mp.get_context("spawn")
    conns, children = {}, []
    for name, (target, args) in targets.items():
        conn, child_conn = context.Pipe()
        child = context.Process(target=target, args=(*args, child_conn))
        child.start()
        conns[name] = conn
        children.append(child)
    try:
        yield conns
    finally:
        for conn in conns.values():
            conn.send(None)
        for child in children:
            child.join()
