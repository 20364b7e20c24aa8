"""Stop strings: find the first one in streamed text, and hold back text that could start one.

Semantics (shared by every detokenizer, and by the reference in the tests):

* **First match** is the one that *ends* first in the text; among stop strings that end at
  the same place, the longest (the one that starts first) wins. Ending first is the only rule
  that does not depend on how the text was chunked: it is the match a reader going through
  the text one character at a time would see first.
* **Search window**: a stop string must end in the new text, so only the new text plus the
  ``longest stop - 1`` characters before it are searched; a match that ended earlier was found
  earlier.
* **Hold-back**: while streaming, the longest suffix of the text that is a proper prefix of
  some stop string is held back, since the next token may complete it. Nothing else is held,
  so a stop set never delays text that cannot start a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inlinelm.errors import RequestError


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Where a stop string was found: ``text[start:end] == stop``."""

    stop: str
    start: int
    end: int


class StopStrings:
    """A request's stop strings, prepared for matching on each engine step.

    Duplicates are dropped; the order of the rest does not matter (see :meth:`find`).
    ``max_len`` is the longest stop's length, ``lookbehind`` how many characters before the
    new text a match may start in (``max_len - 1``). Raises
    :class:`~inlinelm.errors.RequestError` for an empty stop string.
    """

    __slots__ = ("_by_last_char", "_last_chars", "lookbehind", "max_len", "stops")

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        if not all(self.stops):
            raise RequestError("invalid stop: stop strings must be non-empty", param="stop")
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.lookbehind = max(self.max_len - 1, 0)
        self._last_chars = frozenset(s[-1] for s in self.stops)
        self._by_last_char = _proper_prefixes_by_last_char(self.stops)

    def could_end_in(self, new_text: str) -> bool:
        """False when no stop string can end in ``new_text`` (it has none of their last characters)."""
        return not self._last_chars.isdisjoint(new_text)

    def find(self, text: str, new_start: int) -> StopMatch | None:
        """The first stop string (earliest end, then longest) ending in ``text[new_start:]``.

        ``text`` is the new text with up to :attr:`lookbehind` characters of context in front;
        ``new_start`` is where the new text begins. Positions in the result index ``text``.
        """
        best: StopMatch | None = None
        for stop in self.stops:
            first = new_start - len(stop) + 1
            start = text.find(stop, first if first > 0 else 0)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best.end or (end == best.end and start < best.start):
                best = StopMatch(stop, start, end)
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not text:
            return 0
        # NOTE: usually the last character starts no stop prefix and this is one dict lookup.
        for prefix in self._by_last_char.get(text[-1], ()):
            if text.endswith(prefix):
                return len(prefix)
        return 0


def _proper_prefixes_by_last_char(stops: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Every proper prefix of every stop, keyed by its last character, longest first."""
    prefixes = {stop[:k] for stop in stops for k in range(1, len(stop))}
    table: dict[str, list[str]] = {}
    for prefix in sorted(prefixes, key=len, reverse=True):
        table.setdefault(prefix[-1], []).append(prefix)
    return {char: tuple(group) for char, group in table.items()}
