"""The decoding window the incremental detokenizers share: the group released last (context)
and the pending tokens whose text is not out yet. See :mod:`inlinelm.detok.incremental`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 4
"""At most this many prompt tokens prime the window, so the first output token decodes in context."""
MAX_PENDING_TOKENS = 8
"""Past this many tokens without released text, the settled head of the pending group is released."""
KEEP_PENDING_TOKENS = 4
"""Tokens left pending when the head is released: a UTF-8 character spans at most four bytes."""

Unit = TypeVar("Unit")


class Window(Generic[Unit]):
    """The tokens a decoder still needs: the group released last and the pending ones.

    ``decode(group + pending)`` always starts with ``decode(group)`` (the group starts and ends
    where a character does), so the pending text is what follows ``group_text``.
    """

    __slots__ = ("_decode", "_group_text", "group", "pending")

    _decode: Callable[[list[Unit]], str]
    group: list[Unit]
    pending: list[Unit]
    _group_text: str | None

    def __init__(self, decode: Callable[[list[Unit]], str], group: list[Unit]) -> None:
        self._decode = decode
        self.group = group
        self.pending = []
        self._group_text = None

    @property
    def group_text(self) -> str:
        """``decode(group)``, computed when first needed after the group changed."""
        if self._group_text is None:
            self._group_text = self._decode(self.group)
        return self._group_text

    def push(self, unit: Unit) -> str:
        """Add a token; return its text if the window's decode grew without a trailing U+FFFD."""
        self.pending.append(unit)
        text = self._decode(self.group + self.pending)
        if len(text) > len(self.group_text) and not text.endswith(REPLACEMENT_CHAR):
            new_text = text[len(self.group_text) :]
            self.commit()
            return new_text
        return self.settle() or ""

    def commit(self) -> None:
        """The pending tokens' text went out: they become the group."""
        self.group, self.pending = self.pending, []
        self._group_text = None

    def settle(self) -> str | None:
        """Release the head of a long pending group where decoding provably splits.

        ``decode`` splits at a token boundary when ``decode(a + b) == decode(a) + decode(b)``
        and ``b`` has text: a UTF-8 sequence running across the boundary would decode as one
        unit in the whole but as two in the parts. (If ``b`` has no text, ``decode(a)`` must end
        in a whole character instead.) Returns the head's text, or None when nothing moved.
        """
        if len(self.pending) <= MAX_PENDING_TOKENS:
            return None
        cut = len(self.pending) - KEEP_PENDING_TOKENS
        head = self._decode(self.group + self.pending[:cut])
        rest = self._decode(self.pending[cut:])
        if head + rest != self._decode(self.group + self.pending):
            return None
        if not rest and head.endswith(REPLACEMENT_CHAR):
            return None
        new_text = head[len(self.group_text) :]
        self.group, self.pending = self.pending[:cut], self.pending[cut:]
        self._group_text = None
        return new_text

    def drop_group(self) -> None:
        """Forget the context: the pending text is then decoded on its own."""
        self.group = []
        self._group_text = ""

    def flush(self) -> str:
        """All pending text, trailing U+FFFD included; the window is empty of pending tokens."""
        if not self.pending:
            return ""
        text = self._decode(self.group + self.pending)[len(self.group_text) :]
        self.commit()
        return text


def prompt_context(
    prompt_token_ids: Sequence[int], decode: Callable[[list[int]], str]
) -> list[int]:
    """The last few prompt ids to prime a window with: whole characters at both ends, or none.

    A prompt that ends inside a character must not lend its bytes to the output: the output's
    text is ``decode(output_ids)``, where such bytes are U+FFFD.
    """
    for size in range(min(PROMPT_CONTEXT_TOKENS, len(prompt_token_ids)), 0, -1):
        ids = list(prompt_token_ids[-size:])
        text = decode(ids)
        if not (text.startswith(REPLACEMENT_CHAR) or text.endswith(REPLACEMENT_CHAR)):
            return ids
    return []
