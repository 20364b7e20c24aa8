"""Incremental detokenization: token ids in, text out once, exactly as ``tokenizer.decode`` has it.

One contract, :class:`IncrementalDetokenizer`, two ways to decode:

* :class:`FastIncrementalDetokenizer` steps a ``tokenizers.decoders.DecodeStream`` (Rust), for
  tokenizers backed by the ``tokenizers`` library (every transformers fast tokenizer).
* :class:`SlowIncrementalDetokenizer` re-decodes a small window of token strings with
  ``convert_tokens_to_string`` (the vLLM/TGI prefix/read-offset scheme), for any other tokenizer.

Both keep the same window of two token groups: the *group* released last, kept as context so
leading spaces and merges decode right, and the *pending* tokens whose text is not out yet.
Text is released when the window's decode grows and does not end in U+FFFD: a trailing U+FFFD
may still become a character when the next bytes arrive, one inside the text is final. So each
token costs a decode of a few tokens, however long the output grows.

A model can keep the text ending in U+FFFD (a run of lone UTF-8 lead bytes, or the token for a
literal U+FFFD over and over). Then the pending group would grow with the output, so once more
than ``MAX_PENDING_TOKENS`` wait, the head of the group is released where decoding is
provably split (see :meth:`inlinelm.detok.window.Window.settle`), leaving
``KEEP_PENDING_TOKENS`` pending: enough for any UTF-8 character split over byte tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from inlinelm.detok.stop_strings import StopMatch, StopStrings
from inlinelm.detok.window import REPLACEMENT_CHAR, Window, prompt_context


class SlowTokenizer(Protocol):
    """What the slow path needs from a tokenizer (a transformers ``PreTrainedTokenizerBase``)."""

    def convert_ids_to_tokens(self, ids: int) -> str | None: ...

    def convert_tokens_to_string(self, tokens: list[str]) -> str: ...


class IncrementalDetokenizer(ABC):
    """Turns one request's output token ids into text, step by step.

    Contract, for the text ``T = tokenizer.decode(output_ids, skip_special_tokens=...)``:

    * The concatenation of every :meth:`next_output_text` delta, the last one taken with
      ``finished=True``, is ``T``, or ``T`` cut at the first stop string (see
      :mod:`inlinelm.detok.stop_strings`), cut after it with ``include_stop_str_in_output``.
    * A token that ends inside a UTF-8 character yields no text; the character appears once, with
      the token that completes it. A U+FFFD inside the text (an invalid byte sequence) is kept,
      one at the end waits for the next token or the end of the request.
    * A delta never revises earlier text, and never contains the start of a stop string that a
      later token completes.
    * Each step costs the same however long the output is (the cumulative view,
      ``delta=False``, copies the text it returns).

    Stop strings are searched in the text as each step releases it; text that only appears when
    the request finishes (an unresolved trailing U+FFFD) is not searched. No stop string can end
    in the text of the first ``min_tokens`` output tokens. ``stop`` is a list of stop strings,
    or a request's :class:`~inlinelm.detok.StopStrings`, built once and shared by its choices
    (each detokenizer keeps only its own matcher state).
    """

    def __init__(
        self,
        *,
        stop: Sequence[str] | StopStrings = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._stop_strings = _stop_strings(stop)
        self._matcher = None if self._stop_strings is None else self._stop_strings.matcher()
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._token_ids: list[int] = []
        self._released: list[str] = []
        self._num_released = 0  # characters in _released
        self._unreleased = ""
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Every output token id given to :meth:`update` so far (a live view; do not mutate)."""
        return self._token_ids

    @property
    def output_text(self) -> str:
        """All text decoded so far, released or held back (cut at a stop string when one hit)."""
        return "".join(self._released) + self._unreleased

    @property
    def num_chars(self) -> int:
        """How many characters :attr:`output_text` holds (without joining it)."""
        return self._num_released + len(self._unreleased)

    @property
    def stop_strings(self) -> StopStrings | None:
        """The stop strings this detokenizer matches (shared by a request's choices), or None."""
        return self._stop_strings

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, or None."""
        return self._stop_reason

    def update(self, new_token_ids: Sequence[int], *, stop_token: bool = False) -> str | None:
        """Decode the tokens of one engine step; return the stop string they completed, or None.

        The text is cut at the first stop string (earliest end). Once a stop string has
        matched the request is over: later calls decode nothing and return it again.
        ``stop_token``: the last id is the EOS or stop token the engine stopped on; its text
        is left out unless ``include_stop_str_in_output`` (the id stays in the output ids).
        """
        if self._stop_reason is not None or self._finished:
            return self._stop_reason
        if stop_token and not self._include_stop and new_token_ids:
            stop = self.update(new_token_ids[:-1])
            if stop is None:
                self._token_ids.append(new_token_ids[-1])
            return stop
        # NOTE: the matcher has seen the held-back text; it is fed only the new text
        fed_from = searchable_from = len(self._unreleased)
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            text = self._decode_next(token_id)
            if text:
                self._unreleased += text
            if len(self._token_ids) <= self._min_tokens:
                # NOTE: a stop string may start, but not end, in the first min_tokens' text.
                searchable_from = len(self._unreleased)
        matcher = self._matcher
        if matcher is None:
            return None
        match = matcher.feed(self._unreleased, fed_from, searchable_from)
        return None if match is None else self._cut_at(match)

    def next_output_text(self, finished: bool, delta: bool) -> str:
        """Release the text that may go out now.

        With ``delta=True``, the text released since the last call (possibly ``""``: send no
        content chunk then); otherwise all text released so far. While ``finished`` is false,
        the end of the text that could still grow into a stop string is held back. With
        ``finished=True`` (the request ended for any reason) everything goes, including a
        trailing U+FFFD no later token can resolve.
        """
        if finished and not self._finished:
            self._finish()
        hold = 0 if finished or self._matcher is None else self._matcher.num_held
        ready = len(self._unreleased) - hold
        text = ""
        if ready > 0:
            text = self._unreleased[:ready]
            self._unreleased = self._unreleased[ready:]
            self._released.append(text)
            self._num_released += ready
        if delta:
            return text
        self._released = ["".join(self._released)]
        return self._released[0]

    @abstractmethod
    def _decode_next(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while it is not known yet)."""

    @abstractmethod
    def _flush(self) -> str:
        """The text still waiting in the decoder when the request ends."""

    def _cut_at(self, match: StopMatch) -> str:
        # NOTE: hold-back kept every possible match start unreleased
        assert match.start >= 0, "a stop string matched inside text already released"
        cut = match.end if self._include_stop else match.start
        self._unreleased = self._unreleased[:cut]
        self._stop_reason = match.stop
        return match.stop

    def _finish(self) -> None:
        self._finished = True
        if self._stop_reason is None:
            self._unreleased += self._flush()


def _stop_strings(stop: Sequence[str] | StopStrings) -> StopStrings | None:
    """``stop`` prepared for matching (a request's shared table as it is), None for no stops."""
    stops = stop if isinstance(stop, StopStrings) else StopStrings(stop) if stop else None
    return stops if stops is not None and stops.stops else None


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """Incremental detokenizer on ``tokenizers.decoders.DecodeStream`` (decoding in Rust).

    ``tokenizer`` is the ``tokenizers.Tokenizer`` (a transformers fast tokenizer's
    ``backend_tokenizer``). The Python side mirrors the stream's window so it can release a
    long pending group and flush the end; see :class:`IncrementalDetokenizer` for the contract.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopStrings = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        super().__init__(
            stop=stop, include_stop_str_in_output=include_stop_str_in_output, min_tokens=min_tokens
        )
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        context = prompt_context(prompt_token_ids, self._decode)
        self._window: Window[int] = Window(self._decode, context)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skipped_ids or token_id >= self._vocab_size:
            # NOTE: decode() drops these ids; kept out of the window, they cannot grow it.
            return ""
        window = self._window
        window.pending.append(token_id)
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception:  # Rust's InvalidPrefix: the decoder rewrote text it had given out
            return window.flush() + self._restart_stream()
        if text is not None:
            window.commit()
            return text
        settled = window.settle()
        if settled is None:
            return ""
        return settled + self._restart_stream()

    def _restart_stream(self) -> str:
        """A new stream in the window's state: primed with the group, fed the pending ids."""
        window = self._window
        if window.group_text.endswith(REPLACEMENT_CHAR):
            # NOTE: DecodeStream primes only on text without a trailing U+FFFD; with such a
            # group it would emit the group's text again, so go on without context instead.
            window.drop_group()
        self._stream = DecodeStream(ids=window.group, skip_special_tokens=self._skip_special_tokens)
        if not window.pending:
            return ""
        text = self._stream.step(self._tokenizer, list(window.pending))
        if text is None:
            return ""
        window.commit()
        return text

    def _flush(self) -> str:
        return self._window.flush()


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Incremental detokenizer for any transformers tokenizer, on token strings.

    Each token is converted once with ``convert_ids_to_tokens``; each step decodes the small
    window with ``convert_tokens_to_string``. Special tokens are skipped the way the
    tokenizer's own ``decode`` skips them. See :class:`IncrementalDetokenizer` for the contract.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopStrings = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        super().__init__(
            stop=stop, include_stop_str_in_output=include_stop_str_in_output, min_tokens=min_tokens
        )
        self._tokenizer: SlowTokenizer = tokenizer
        self._skipped_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        context = prompt_context(prompt_token_ids, self._decode_ids)
        self._window: Window[str] = Window(
            tokenizer.convert_tokens_to_string, self._to_tokens(context)
        )

    def _to_tokens(self, ids: list[int]) -> list[str]:
        tokens = (
            self._tokenizer.convert_ids_to_tokens(i) for i in ids if i not in self._skipped_ids
        )
        return [token for token in tokens if token is not None]

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tokenizer.convert_tokens_to_string(self._to_tokens(ids))

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skipped_ids:
            return ""
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # an id past the vocabulary (padded embeddings) decodes to nothing
            return ""
        return self._window.push(token)

    def _flush(self) -> str:
        return self._window.flush()


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``tokenizer.decode(..., skip_special_tokens=True)`` leaves out.

    A tokenizers-backed tokenizer skips every added token marked special (the Rust decoder's
    rule, wider than ``all_special_ids``); a Python tokenizer skips ``all_special_ids``.
    """
    backend = _backend_tokenizer(tokenizer)
    if backend is not None:
        added = backend.get_added_tokens_decoder().items()
        return frozenset(i for i, token in added if token.special)
    return frozenset(tokenizer.all_special_ids)


def make_detokenizer(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    stop: Sequence[str] | StopStrings = (),
    include_stop_str_in_output: bool = False,
    min_tokens: int = 0,
) -> IncrementalDetokenizer:
    """An incremental detokenizer for one request: the fast path whenever the tokenizer has one.

    ``tokenizer`` is a transformers tokenizer or a ``tokenizers.Tokenizer``. The text matches
    ``tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)``.
    ``spaces_between_special_tokens`` is accepted for API compatibility and changes nothing:
    transformers 5 ``decode`` ignores it for every tokenizer backend, and the streamed text
    must equal the decoded one.
    """
    del spaces_between_special_tokens
    options: dict[str, Any] = {
        "skip_special_tokens": skip_special_tokens,
        "stop": stop,
        "include_stop_str_in_output": include_stop_str_in_output,
        "min_tokens": min_tokens,
    }
    backend = _backend_tokenizer(tokenizer)
    if backend is not None:
        return FastIncrementalDetokenizer(backend, prompt_token_ids, **options)
    return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, **options)


def _backend_tokenizer(tokenizer: Any) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None
