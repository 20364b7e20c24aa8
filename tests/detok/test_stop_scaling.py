"""A long stop string costs memory and work linear in its length: its table keeps a few bytes
per character, and text that follows it streams at a bounded number of calls per character,
however long the stop (the caps on count and length are the engine's, and can be raised).

Work is counted as Python and C calls (``sys.setprofile``), not timed."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer

from inlinelm.detok import FastIncrementalDetokenizer, StopStrings

LONG = 20_000
BYTES_PER_CHAR = 32
"""The table's budget per stop character: three int32 links (12 bytes), a flag byte and the
character itself (up to 4) per trie node, plus the copies made while joining the characters
(up to 8). A table of every prefix of the stop needs about ``LONG / 2`` bytes per character."""
CALLS_PER_CHAR = 50
"""Calls per streamed character: the detokenizer's dozen or so per token (a token has at least
one character) and the matcher's few per character. A scan over the stop's prefixes makes
about ``LONG / 4`` per character of this text."""


def traced_peak(build: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        kept = build()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept is not None
    return peak


def count_calls(run: Callable[[], None]) -> int:
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize(
    "stop",
    ["a" * LONG, ("👋 hello, wörld " * LONG)[:LONG], "".join(chr(0x4E00 + i) for i in range(LONG))],
    ids=["one-char", "mixed-4-byte", "all-distinct"],
)
def test_a_long_stops_table_is_a_few_bytes_per_character(stop: str) -> None:
    assert traced_peak(lambda: StopStrings([stop])) < BYTES_PER_CHAR * LONG


def test_sixteen_long_stops_cost_the_same_per_character() -> None:
    stops = [f"{i:02d}" + "abc" * (LONG // 3) for i in range(16)]
    assert traced_peak(lambda: StopStrings(stops)) < BYTES_PER_CHAR * sum(map(len, stops))


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected", "early"),
    [
        # every character could still start the stop: all held back, all out at the end
        ("a" * 4000, "a" * LONG, False, "a" * 4000, ""),
        # a self-overlapping stop matched after 10,000 characters of hold-back
        ("ab" * 6000, "ab" * 5000, True, "ab" * 5000, ""),
        ("x" + "ab" * 6000, "ab" * 5000, False, "x", "x"),
    ],
    ids=["held-back", "match-include", "match-cut"],
)
def test_text_following_a_long_stop_streams_at_bounded_calls_per_character(
    backend: Tokenizer, text: str, stop: str, include: bool, expected: str, early: str
) -> None:
    ids = backend.encode(text, add_special_tokens=False).ids
    detok = FastIncrementalDetokenizer(backend, [], stop=[stop], include_stop_str_in_output=include)
    deltas: list[str] = []

    def run() -> None:
        for token_id in ids:
            if detok.update([token_id]) is not None:
                break
            deltas.append(detok.next_output_text(finished=False, delta=True))

    calls = count_calls(run)
    deltas.append(detok.next_output_text(finished=True, delta=True))
    assert "".join(deltas) == expected
    assert "".join(deltas[:-1]) == early  # what no stop could start went out at once
    assert calls < CALLS_PER_CHAR * len(text)
