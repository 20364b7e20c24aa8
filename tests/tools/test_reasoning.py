"""Reasoning parsers: what each family's output splits into, and a stream of its deltas,
cut anywhere (a tag straddling them included), adding up to that split exactly, with no tag
text in either part."""

from __future__ import annotations

import itertools
import random

import pytest

from inlinelm.reasoning import (
    PARSERS,
    ReasoningSplit,
    TagReasoningParser,
    get_reasoning_parser,
)

CASES = {
    "qwen3": [
        ("<think>\nplan it</think>\n\nHello!", "\nplan it", "Hello!"),
        ("Hello, no thinking.", None, "Hello, no thinking."),
        ("\n<think>a</think>b", "a", "b"),
        ("<think>plan, cut by max_tokens", "plan, cut by max_tokens", None),
        ("<think></think>\n\nanswer", None, "answer"),
        ("<think>a</think>b</think>c", "a", "b</think>c"),
        ("<thi", None, "<thi"),
        ("<think>a</thin", "a</thin", None),
        ("  ", None, None),
        ("", None, None),
        ("x<think>y</think>z", None, "x<think>y</think>z"),
    ],
    "deepseek_r1": [
        ("plan it</think>\n\nHello!", "plan it", "Hello!"),
        ("<think>\nplan it</think>Hello!", "\nplan it", "Hello!"),
        ("plan, cut by max_tokens", "plan, cut by max_tokens", None),
        ("</think>answer", None, "answer"),
        ("<b>bold</b> thought</think> ok", "<b>bold</b> thought", "ok"),
        ("<thi", "<thi", None),
        ("", None, None),
    ],
}


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [(name, *case) for name, cases in CASES.items() for case in cases],
)
def test_each_family_splits_its_output_at_the_tags(
    name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    assert get_reasoning_parser(name).split(text) == ReasoningSplit(reasoning, content)


def _streamed(parser: TagReasoningParser, deltas: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning = content = ""
    for delta in deltas:
        r, c = stream.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


def _cuts(text: str, rng: random.Random) -> list[list[str]]:
    """The text in one delta, cut at every point into two, a character at a time, and in
    random pieces."""
    ways = [[text], list(text)]
    ways += [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        points = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 3))) if len(text) > 1 else []
        )
        bounds = [0, *points, len(text)]
        ways.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return ways


@pytest.mark.parametrize(
    ("name", "text"), [(name, case[0]) for name, cases in CASES.items() for case in cases]
)
def test_a_stream_cut_anywhere_adds_up_to_the_whole_split(name: str, text: str) -> None:
    parser = get_reasoning_parser(name)
    whole = parser.split(text)
    want = (whole.reasoning or "", whole.content or "")
    for deltas in _cuts(text, random.Random(text)):
        assert _streamed(parser, deltas) == want, deltas


def test_no_tag_text_leaks_into_either_part_of_a_stream() -> None:
    """Token by token, a closing tag cut in three never shows in the reasoning deltas."""
    stream = PARSERS["deepseek_r1"].stream()
    seen = []
    for delta in ["Let me think", ". </", "thi", "nk>", "\n\nThe answer", " is 4."]:
        seen.append(stream.feed(delta))
    seen.append(stream.finish())
    assert seen == [
        ("Let me think", ""),
        (". ", ""),
        ("", ""),
        ("", ""),
        ("", "The answer"),
        ("", " is 4."),
        ("", ""),
    ]


def test_a_parser_takes_any_two_tags_and_names_the_known_ones() -> None:
    parser = TagReasoningParser("custom", "[THINK]", "[/THINK]")
    assert parser.split("[THINK]x[/THINK] y") == ReasoningSplit("x", "y")
    assert _streamed(parser, list("[THINK]x[/THINK] y")) == ("x", "y")
    with pytest.raises(ValueError, match="two non-empty tags"):
        TagReasoningParser("bad", "", "</think>")
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
