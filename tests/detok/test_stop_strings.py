"""StopStrings: first match by earliest end, search window, hold-back of possible stop starts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inlinelm.detok import StopMatch, StopMatcher, StopStrings
from inlinelm.errors import RequestError
from tests.detok.reference import reference_holdback

SMALL_TEXT = st.text(alphabet="abc👋é", max_size=12)
STOPS = st.lists(st.text(alphabet="abc👋é", min_size=1, max_size=4), min_size=1, max_size=4)


def brute_force_find(text: str, new_start: int, stops: list[str]) -> StopMatch | None:
    for end in range(new_start + 1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            stop = max(found, key=len)
            return StopMatch(stop, end - len(stop), end)
    return None


def test_earliest_end_wins_over_list_order() -> None:
    stops = StopStrings(["abcd", "bc"])
    assert stops.find("xabcd", 0) == StopMatch("bc", 2, 4)


def test_same_end_prefers_the_longest() -> None:
    stops = StopStrings(["bc", "abc"])
    assert stops.find("xabc", 0) == StopMatch("abc", 1, 4)


def test_match_must_end_in_new_text() -> None:
    stops = StopStrings(["ab"])
    assert stops.find("abab", 2) == StopMatch("ab", 2, 4)
    assert stops.find("abx", 2) is None
    # a match straddling the boundary counts
    assert stops.find("xab", 2) == StopMatch("ab", 1, 3)


def test_holdback_is_the_longest_proper_prefix_suffix() -> None:
    stops = StopStrings(["</end>", "<|im_end|>"])
    assert stops.holdback("text </e") == 3
    assert stops.holdback("text <") == 1
    assert stops.holdback("text <|im_en") == 7
    assert stops.holdback("text </end>") == 0  # a whole stop string is a match, not a prefix
    assert stops.holdback("plain text") == 0
    assert stops.holdback("") == 0


def test_lookbehind_and_duplicates() -> None:
    stops = StopStrings(["ab", "ab", "abcd"])
    assert stops.stops == ("ab", "abcd")
    assert stops.lookbehind == 3
    assert StopStrings(["x"]).lookbehind == 0


def test_empty_stop_string_is_a_request_error() -> None:
    with pytest.raises(RequestError) as info:
        StopStrings(["ok", ""])
    assert info.value.param == "stop"


@settings(max_examples=300, deadline=None)
@given(text=SMALL_TEXT, stops=STOPS, data=st.data())
def test_find_matches_brute_force(text: str, stops: list[str], data: st.DataObject) -> None:
    new_start = data.draw(st.integers(0, len(text)))
    assert StopStrings(stops).find(text, new_start) == brute_force_find(text, new_start, stops)


@settings(max_examples=300, deadline=None)
@given(text=SMALL_TEXT, stops=STOPS)
def test_holdback_matches_brute_force(text: str, stops: list[str]) -> None:
    assert StopStrings(stops).holdback(text) == reference_holdback(text, stops)


def test_overlapping_and_self_overlapping_stops() -> None:
    assert StopStrings(["abab"]).find("xababab", 0) == StopMatch("abab", 1, 5)
    assert StopStrings(["aaa"]).find("aaaa", 3) == StopMatch("aaa", 1, 4)
    assert StopStrings(["aaa"]).holdback("xaa") == 2
    # after "abab" fails on "c", "ab" is still a live prefix (the failure link)
    assert StopStrings(["ababc", "abx"]).find("ababx", 0) == StopMatch("abx", 2, 5)
    assert StopStrings(["ababc"]).holdback("ababab") == 4


def test_a_stop_that_is_a_prefix_of_another_ends_first() -> None:
    stops = StopStrings(["abc", "ab"])
    assert stops.find("xabc", 0) == StopMatch("ab", 1, 3)
    assert stops.holdback("xa") == 1
    assert stops.holdback("xab") == 2  # a whole stop, but also the start of "abc"


def test_a_passed_over_match_keeps_its_failure_hold_back() -> None:
    # "ab" ends in the exempt text (min_tokens); "b" may still start "bc"
    matcher = StopStrings(["ab", "bc"]).matcher()
    assert matcher.feed("ab", 0, 2) is None
    assert matcher.num_held == 1
    assert matcher.feed("abc", 2, 2) == StopMatch("bc", 1, 3)


def test_no_stop_strings_never_match() -> None:
    matcher = StopStrings([]).matcher()
    assert matcher.feed("anything", 0, 0) is None
    assert matcher.num_held == 0


# Tiny alphabets make overlaps, self-overlaps and failure links the rule, not the exception.
DENSE_TEXT = st.text(alphabet="ab", max_size=24) | st.text(alphabet="abc", max_size=24)
TRAPS = ["a", "aa", "aaa", "ab", "abab", "bab", "aab", "abaab", "abc", "bca", "cab"]
DENSE_STOPS = st.lists(
    st.sampled_from(TRAPS) | st.text(alphabet="abc", min_size=1, max_size=7), min_size=1, max_size=6
)


def feed_in_chunks(
    matcher: StopMatcher, text: str, ends: list[int], searchable_from: int, stops: list[str]
) -> StopMatch | None:
    """Feed ``text`` cut at ``ends``; between chunks the hold-back must match the reference."""
    fed = 0
    for end in [*ends, len(text)]:
        found = matcher.feed(text[:end], fed, searchable_from)
        if found is not None:
            assert fed < found.end <= end
            return found
        assert matcher.num_held == reference_holdback(text[:end], stops)
        fed = end
    return None


@settings(max_examples=1000, deadline=None)
@given(text=DENSE_TEXT, stops=DENSE_STOPS, data=st.data())
def test_matcher_in_any_chunking_matches_the_whole_text_reference(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts")
    searchable_from = data.draw(st.integers(0, len(text)), label="searchable_from")
    found = feed_in_chunks(StopStrings(stops).matcher(), text, sorted(cuts), searchable_from, stops)
    assert found == brute_force_find(text, searchable_from, stops)


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(DENSE_TEXT, min_size=2, max_size=4), stops=DENSE_STOPS, data=st.data())
def test_choices_sharing_one_table_match_as_if_alone(
    texts: list[str], stops: list[str], data: st.DataObject
) -> None:
    # the table's links fill in as texts reach them: interleaved choices must not see each other
    shared = StopStrings(stops)
    matchers = [shared.matcher() for _ in texts]
    fed = [0] * len(texts)
    found: list[StopMatch | None] = [None] * len(texts)
    chunk = st.tuples(st.integers(0, len(texts) - 1), st.integers(1, 4))
    steps = data.draw(st.lists(chunk, max_size=60), label="steps")
    for i, size in [*steps, *((i, 99) for i in range(len(texts)))]:
        if found[i] is None and fed[i] < len(texts[i]):
            end = min(fed[i] + size, len(texts[i]))
            found[i] = matchers[i].feed(texts[i][:end], fed[i], 0)
            if found[i] is None:
                assert matchers[i].num_held == reference_holdback(texts[i][:end], stops)
            fed[i] = end
    assert found == [brute_force_find(text, 0, stops) for text in texts]
