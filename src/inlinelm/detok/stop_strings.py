"""Stop strings: find the first one in streamed text, and hold back text that could start one.

Semantics (shared by every detokenizer, and by the reference in the tests):

* **First match** is the one that *ends* first in the text; among stop strings that end at
  the same place, the longest (the one that starts first) wins. Ending first is the only rule
  that does not depend on how the text was chunked: it is the match a reader going through
  the text one character at a time would see first.
* **Hold-back**: while streaming, the longest suffix of the text that is a proper prefix of
  some stop string is held back, since the next token may complete it. Nothing else is held,
  so a stop set never delays text that cannot start a stop string.

How: a request's :class:`StopStrings` is an Aho–Corasick automaton over its stop strings
(:mod:`inlinelm.detok.stop_automaton`), built once and shared by the request's choices (its
failure links fill in as texts reach them, the same whichever choice gets there first, all on
the request's event loop). Each choice's :class:`StopMatcher` holds only its state: the node
of the longest suffix of its text that is a prefix of a stop. Each new character is fed
once, so a step costs the length of its own text, however long the stops or the output; at
the root, a C-level check passes over new text in which no character starts a stop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inlinelm.detok.stop_automaton import StopAutomaton
from inlinelm.errors import RequestError


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Where a stop string was found: ``text[start:end] == stop``."""

    stop: str
    start: int
    end: int


class StopStrings:
    """A request's stop strings, prepared once for every choice's :class:`StopMatcher`.

    Duplicates are dropped; the order of the rest does not matter. ``max_len`` is the longest
    stop's length; a hold-back is at most ``lookbehind`` (``max_len - 1``) characters. Raises
    :class:`~inlinelm.errors.RequestError` for an empty stop string. Building costs a few
    C-level string operations per stop, whatever their lengths (the caps on count and length
    are the engine's, see ``EngineConfig.max_stop_strings``).
    """

    __slots__ = ("_automaton", "lookbehind", "max_len", "stops")

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        if not all(self.stops):
            raise RequestError("invalid stop: stop strings must be non-empty", param="stop")
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.lookbehind = max(self.max_len - 1, 0)
        self._automaton = StopAutomaton(self.stops)

    def matcher(self) -> StopMatcher:
        """A fresh matcher (at the start of a text) for one choice."""
        return StopMatcher(self._automaton)

    def find(self, text: str, new_start: int) -> StopMatch | None:
        """The first stop string (earliest end, then longest) ending in ``text[new_start:]``.

        A whole-text convenience (a fresh matcher fed ``text``); positions index ``text``.
        """
        return self.matcher().feed(text, 0, new_start)

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        matcher = self.matcher()
        matcher.feed(text, 0, len(text))
        return matcher.num_held


class StopMatcher:
    """One choice's progress through its request's stop strings.

    Feed it the text as it grows, each character once (:meth:`feed`); :attr:`num_held` is
    then how much of the end of the text fed so far could still start a stop string.
    """

    __slots__ = ("_automaton", "_first_chars", "_roots", "_state", "num_held")

    def __init__(self, automaton: StopAutomaton) -> None:
        self._automaton = automaton
        self._first_chars = automaton.first_chars
        self._roots = automaton.root_children
        self._state = 0
        # NOTE: a plain attribute, kept equal to the state's hold-back, since it is read for
        # every streamed token
        self.num_held = 0

    def feed(self, text: str, start: int, searchable_from: int) -> StopMatch | None:
        """Feed ``text[start:]``, the text that follows what was fed before; return the first
        stop string that ends after ``text[:searchable_from]``, or None.

        Stops ending earlier (in the text of the first ``min_tokens`` tokens) are passed
        over, though they may still start there. Positions in the result index ``text``.
        After a match the matcher is spent: the request it serves is over.
        """
        # NOTE: the common case, one C-level check: at the root, and no character of the new
        # text starts a stop (usually the text is all new: nothing was held back)
        if self._state == 0 and self._first_chars.isdisjoint(text[start:] if start else text):
            return None
        return self._run(text, start, searchable_from)

    def _run(self, text: str, pos: int, searchable_from: int) -> StopMatch | None:
        automaton = self._automaton
        next_chars, more, fail, match, roots = (
            automaton.next_chars,
            automaton.more,
            automaton.fail,
            automaton.match,
            self._roots,
        )
        node = self._state
        end = len(text)
        while pos < end:
            char = text[pos]
            pos += 1
            if node == 0:
                node = roots.get(char, 0)
                if node == 0:
                    continue
            elif next_chars[node] == char and more[node]:
                node += 1  # the usual step, down the node's own chain, inlined
            else:
                node = automaton.goto(node, char)
                if node == 0:
                    continue
            if fail[node] < 0:  # the first text to reach this node
                automaton.reach(node)
            found = match[node]
            if found and pos > searchable_from:
                self._stay(node)
                stop = automaton.stops[found - 1]
                return StopMatch(stop, pos - len(stop), pos)
        self._stay(node)
        return None

    def _stay(self, node: int) -> None:
        self._state = node
        self.num_held = self._automaton.hold[node]
