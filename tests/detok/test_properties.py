"""Property tests on the real SmolLM2 tokenizer: streamed text equals the whole decode.

For every input, both paths must agree delta for delta, and match the references in
``tests/detok/reference.py``: ``tokenizer.decode`` of all ids, the text known after each token
(text appears with the token that completes it), and stop strings on the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from inlinelm.detok import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    StopStrings,
)
from tests.detok.reference import (
    FFFD,
    PIECES,
    chunked,
    reference_holdback,
    reference_stop,
    released_texts,
    settles,
    stream,
)

TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=14).map("".join)
SIZES = st.lists(st.integers(1, 5), min_size=1, max_size=6)
VOCAB_SIZE = 49152


def both_paths(tokenizer: Any, prompt: list[int], **options: Any) -> list[IncrementalDetokenizer]:
    return [
        FastIncrementalDetokenizer(tokenizer.backend_tokenizer, prompt, **options),
        SlowIncrementalDetokenizer(tokenizer, prompt, **options),
    ]


def check_streams_like_decode(
    tokenizer: Any, prompt: list[int], ids: list[int], sizes: Sequence[int], skip: bool
) -> None:
    backend: Tokenizer = tokenizer.backend_tokenizer
    expected = tokenizer.decode(ids, skip_special_tokens=skip)

    # 1) any chunking: the deltas add up to the whole decode, the same on both paths
    fast, slow = (
        stream(d, chunked(ids, sizes))
        for d in both_paths(tokenizer, prompt, skip_special_tokens=skip)
    )
    assert fast.deltas == slow.deltas
    assert fast.text == expected
    if FFFD not in expected:
        assert not any(FFFD in d for d in fast.deltas)

    # 2) one token at a time: text is released with the token that completes it
    def decode(part: list[int]) -> str:
        return backend.decode(part, skip_special_tokens=skip)

    if settles(decode, ids):
        return  # a long U+FFFD run is released early on purpose; covered by unit tests
    detok = FastIncrementalDetokenizer(backend, prompt, skip_special_tokens=skip)
    released = ""
    for token, known in zip(ids, released_texts(decode, ids)[1:], strict=True):
        detok.update([token])
        released += detok.next_output_text(finished=False, delta=True)
        assert released == known


@settings(max_examples=500, deadline=None)
@given(text=TEXT, sizes=SIZES, skip=st.booleans())
def test_text_streams_like_decode(
    tokenizer: Any, prompt_ids: list[int], text: str, sizes: list[int], skip: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_streams_like_decode(tokenizer, prompt_ids, ids, sizes, skip)


@settings(max_examples=500, deadline=None)
@given(sizes=SIZES, skip=st.booleans(), data=st.data())
def test_random_ids_stream_like_decode(
    tokenizer: Any, awkward_ids: list[int], sizes: list[int], skip: bool, data: st.DataObject
) -> None:
    token = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from(awkward_ids))
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    prompt = data.draw(st.lists(token, max_size=6), label="prompt")
    check_streams_like_decode(tokenizer, prompt, ids, sizes, skip)


def test_every_split_point_gives_the_same_text(tokenizer: Any, prompt_ids: list[int]) -> None:
    ids = tokenizer.encode("".join(PIECES), add_special_tokens=False)
    for skip in (True, False):
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        for cut in range(len(ids) + 1):
            for detok in both_paths(tokenizer, prompt_ids, skip_special_tokens=skip):
                assert stream(detok, [ids[:cut], ids[cut:]]).text == expected, (skip, cut)


def draw_stops(data: st.DataObject, text: str) -> list[str]:
    """Stop strings that occur in the text (so they straddle tokens), overlap and nest:
    prefixes and suffixes of each other, self-overlapping ones ("aaa", "abab", "abca")."""
    sliced = st.builds(
        lambda start, size: text[start : start + size], st.integers(0, len(text)), st.integers(1, 6)
    )
    base = st.one_of(sliced, st.text(min_size=1, max_size=3), st.sampled_from(PIECES))
    stops: list[str] = data.draw(st.lists(base, min_size=1, max_size=3), label="stops")
    for stop in list(stops):
        variants = {
            "none": "",
            "prefix": stop[:-1],
            "suffix": stop[1:],
            "self-overlap": stop + stop[:1],
            "run": stop[:1] * 3,
            "period": stop[:2] * 2,
        }
        stops.append(variants[data.draw(st.sampled_from(sorted(variants)))])
    return [s for s in stops if s]


@settings(max_examples=500, deadline=None)
@given(
    text=TEXT,
    sizes=SIZES,
    other_sizes=SIZES,
    include=st.booleans(),
    skip=st.booleans(),
    data=st.data(),
)
def test_stop_strings_match_the_whole_text_reference(
    tokenizer: Any,
    prompt_ids: list[int],
    text: str,
    sizes: list[int],
    other_sizes: list[int],
    include: bool,
    skip: bool,
    data: st.DataObject,
) -> None:
    backend: Tokenizer = tokenizer.backend_tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)

    def decode(part: list[int]) -> str:
        return backend.decode(part, skip_special_tokens=skip)

    assume(not settles(decode, ids))
    texts = released_texts(decode, ids)
    stops = draw_stops(data, texts[-1])
    min_tokens = data.draw(st.integers(0, len(ids)), label="min_tokens")
    expected = reference_stop(texts, decode(ids), stops, include, min_tokens)

    options = {
        "skip_special_tokens": skip,
        "include_stop_str_in_output": include,
        "min_tokens": min_tokens,
    }
    # NOTE: the fast path and a second choice share one table, as a request's choices do
    shared = StopStrings(stops)
    chunks = chunked(ids, sizes)
    fast = stream(FastIncrementalDetokenizer(backend, prompt_ids, stop=shared, **options), chunks)
    slow = stream(SlowIncrementalDetokenizer(tokenizer, prompt_ids, stop=stops, **options), chunks)
    assert fast.deltas == slow.deltas
    assert (fast.stop, fast.text) == (expected.stop, expected.text)
    second = FastIncrementalDetokenizer(backend, prompt_ids, stop=shared, **options)
    again = stream(second, chunked(ids, other_sizes))
    assert (again.stop, again.text) == (expected.stop, expected.text)
    if expected.stop_token is not None:
        # the stop is reported by the update that holds the token completing it
        first_in_chunk = fast.num_fed_tokens - fast.last_chunk_size + 1
        assert first_in_chunk <= expected.stop_token <= fast.num_fed_tokens


@settings(max_examples=300, deadline=None)
@given(text=TEXT, data=st.data())
def test_holdback_is_exactly_the_possible_stop_start(
    tokenizer: Any, text: str, data: st.DataObject
) -> None:
    backend: Tokenizer = tokenizer.backend_tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)

    def decode(part: list[int]) -> str:
        return backend.decode(part, skip_special_tokens=True)

    assume(not settles(decode, ids))
    texts = released_texts(decode, ids)
    stops = draw_stops(data, texts[-1])
    detok = FastIncrementalDetokenizer(backend, [], stop=stops)
    released = ""
    for token, known in zip(ids, texts[1:], strict=True):
        if detok.update([token]) is not None:
            break
        released += detok.next_output_text(finished=False, delta=True)
        assert released == known[: len(known) - reference_holdback(known, stops)]
