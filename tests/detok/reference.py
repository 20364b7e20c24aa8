"""Whole-text references for the detokenizer tests, and a driver that streams ids through one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inlinelm.detok import IncrementalDetokenizer
from inlinelm.detok.window import MAX_PENDING_TOKENS

FFFD = "\ufffd"
Decode = Callable[[list[int]], str]

# Pieces of text the property tests build from: each is a known trouble spot.
PIECES = (
    # emoji: skin tones, ZWJ families, flags, keycaps, variation selectors
    "👋", "👋🏽", "👨‍👩‍👧‍👦", "🧑🏿‍💻", "🏳️‍🌈", "🇫🇷", "1️⃣", "❤️", "😀😃", "🤖",
    # CJK, Korean, Japanese
    "你好", "世界", "日本語", "한국어", "カタカナ", "，", "。",
    # accents and combining marks
    "é", "e\u0301", "a\u0308\u0301", "Å", "ñ", "ß", "Ω",
    # right-to-left
    "مرحبا", "שלום", "\u200f",
    # whitespace runs
    " ", "  ", "\t", "\n", "\n\n", "   \n", "\u00a0", "\u3000",
    # code and markdown
    "def f(x):\n    return x", "{\"a\": [1, 2]}", "```python\n", "`x`", "**bold**", "<div>", "->",
    # words
    "hello", " world", "Hello", ".", " the", "stop", "END", "###",
    # special tokens, and text that only looks like one
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<|im_", "|>",
    # a literal replacement character
    FFFD,
)  # fmt: skip


@dataclass
class Streamed:
    """What a detokenizer released while a list of chunks was fed to it."""

    deltas: list[str]
    stop: str | None
    num_fed_tokens: int
    last_chunk_size: int

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def stream(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> Streamed:
    """Feed chunks until one completes a stop string; release after each; finish at the end."""
    deltas: list[str] = []
    fed = last = 0
    stop = None
    for chunk in chunks:
        stop = detok.update(list(chunk))
        fed, last = fed + len(chunk), len(chunk)
        if stop is not None:
            break
        deltas.append(detok.next_output_text(finished=False, delta=True))
    deltas.append(detok.next_output_text(finished=True, delta=True))
    return Streamed(deltas, stop, fed, last)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """``ids`` cut into chunks of the given sizes (cycled), the last one taking the rest."""
    chunks: list[list[int]] = []
    start = 0
    sizes = list(sizes) or [1]
    while start < len(ids):
        size = max(sizes[len(chunks) % len(sizes)], 1)
        chunks.append(list(ids[start : start + size]))
        start += size
    return chunks


def released_texts(decode: Decode, ids: Sequence[int]) -> list[str]:
    """``T[k]``: the text known after ``k`` tokens, the decode of the longest prefix of
    ``ids[:k]`` that does not end in U+FFFD (a trailing U+FFFD may still become a character)."""
    texts = [""]
    for k in range(1, len(ids) + 1):
        text = decode(list(ids[:k]))
        texts.append(texts[-1] if text.endswith(FFFD) else text)
    return texts


def longest_wait(decode: Decode, ids: Sequence[int]) -> int:
    """The most tokens in a row whose prefix decode ends in U+FFFD."""
    run = longest = 0
    for k in range(1, len(ids) + 1):
        run = run + 1 if decode(list(ids[:k])).endswith(FFFD) else 0
        longest = max(longest, run)
    return longest


def settles(decode: Decode, ids: Sequence[int]) -> bool:
    """Whether a detokenizer would release a long pending group early on these ids."""
    return longest_wait(decode, ids) > MAX_PENDING_TOKENS


@dataclass
class StopResult:
    """The reference outcome of a request with stop strings."""

    stop: str | None
    text: str
    stop_token: int | None  # 1-based index of the token that completed the stop string


def reference_stop(
    texts: list[str], full_text: str, stops: Sequence[str], include: bool, min_tokens: int
) -> StopResult:
    """Stop strings on whole texts: the earliest-ending match (longest on a tie) that ends after
    the text of the first ``min_tokens`` tokens; cut before it, or after it with ``include``."""
    final = texts[-1]
    exempt = len(texts[min(min_tokens, len(texts) - 1)])
    for end in range(exempt + 1, len(final) + 1):
        found = [s for s in stops if final[:end].endswith(s)]
        if found:
            stop = max(found, key=len)
            stop_token = next(k for k, t in enumerate(texts) if len(t) >= end)
            return StopResult(stop, final[: end if include else end - len(stop)], stop_token)
    return StopResult(None, full_text, None)


def reference_holdback(text: str, stops: Sequence[str]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )
