"""One choice's grammar state on the engine thread: which tokens may come next, and the
tokens generated so far fed through it.

A :class:`GrammarMatcher` is made at submit (a copy of the compiled grammar's validated
template), handed to the engine thread with its request, and used only there from then on:
the runner fills its bitmask row before sampling, the scheduler feeds it the sampled token.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("inlinelm")


class GrammarMatcher:
    """An llguidance matcher for one sequence (wraps ``llguidance.LLMatcher``).

    ``vocab_size`` is the tokenizer's: a bitmask row has ``ceil(vocab_size / 32)`` int32
    words, bit ``t`` set when token ``t`` is allowed next. Once the grammar is complete the
    mask allows only EOS; a token the grammar refuses puts the matcher in error for good.
    """

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    @property
    def ll_matcher(self) -> Any:
        """The wrapped ``llguidance.LLMatcher`` (for batched mask filling)."""
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Feed one sampled token; False (and an error state) when the grammar refuses it,
        or when it was already in error (a mask it could not compute)."""
        ok: bool = self._matcher.consume_token(token_id)
        if not ok:
            logger.warning("grammar refused token %d: %s", token_id, self.error)
        return ok

    @property
    def is_stopped(self) -> bool:
        """True once the output is complete (its mask then allows only EOS), or on error."""
        stopped: bool = self._matcher.is_stopped()
        return stopped

    @property
    def error(self) -> str | None:
        """The error's first line, when a refused token or a mask the grammar's limits cut
        short stopped the matcher (llguidance follows it with a dump of its state and the
        whole grammar, which belongs in neither a log line nor a client's error)."""
        if not self._matcher.is_error():
            return None
        message: str = self._matcher.get_error()
        return message.split("\n", 1)[0].strip()


class ReasoningGate:
    """A grammar held back while a reasoning model thinks: it constrains only what comes
    after the closing tag (``end_ids``: the tag's token ids), so the reasoning is free,
    bounded by ``max_tokens`` alone. The engine thread opens it on the token that
    completes the tag, which the grammar never sees."""

    __slots__ = ("end_ids", "matcher")

    def __init__(self, matcher: GrammarMatcher, end_ids: tuple[int, ...]) -> None:
        assert end_ids, "a reasoning gate needs the closing tag's tokens"
        self.matcher = matcher
        self.end_ids = end_ids

    def opens_after(self, output_token_ids: list[int]) -> bool:
        """Whether the output now ends with the closing tag."""
        n = len(self.end_ids)
        return tuple(output_token_ids[-n:]) == self.end_ids
