"""StopStrings: first match by earliest end, search window, hold-back of possible stop starts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inlinelm.detok import StopMatch, StopStrings
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
