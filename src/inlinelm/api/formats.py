"""How engine outputs become OpenAI choices: one format for chat, one for completions.

A format turns one choice's news into a choice dict. The stream driver
(:mod:`inlinelm.api.sse`) and the whole-response builder (:mod:`inlinelm.api.serving`) use
the same formats, so streamed and non-streamed answers cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from inlinelm.api.responses import (
    TokenTexts,
    chat_choice,
    chat_delta_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    next_text_offset,
)
from inlinelm.runtime.outputs import CompletionOutput, TokenLogprobs


class ChoiceFormat(Protocol):
    """Builds the choices of one request's chunks and of its whole response."""

    chunk_object: str
    response_object: str

    def opening(self, index: int) -> dict[str, Any] | None:
        """The first chunk's choice for ``index`` (chat: the role), or None for none."""

    def delta(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        reason: str | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any] | None:
        """A chunk choice with new text, its tokens' logprobs, and the ``finish_reason``
        when this is the choice's last text; None when the format holds the text back for
        now (tool calls: :mod:`inlinelm.api.tool_format`), which it never does for a
        choice's last text. ``reasoning``: a reasoning model's thinking released with the
        text (only :class:`~inlinelm.api.reasoning_format.ReasoningChatFormat` is given
        any; ``text`` is never empty without it)."""

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        """The closing chunk choice when the last step released no text: the ``finish_reason``."""

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        """A choice of the whole response, from the choice's final output."""


@dataclass(slots=True)
class ChatFormat:
    """``chat.completion(.chunk)`` choices; ``logprobs`` says whether the client asked for them."""

    texts: TokenTexts
    logprobs: bool
    chunk_object: str = "chat.completion.chunk"
    response_object: str = "chat.completion"

    def opening(self, index: int) -> dict[str, Any] | None:
        return chat_delta_choice(index, {"role": "assistant", "content": ""})

    def delta(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        reason: str | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        return chat_delta_choice(index, {"content": text}, reason, self._logprobs(logprobs))

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        # NOTE: only when the finishing step released no text; logprobs of tokens whose
        # text was never released (held back, then dropped) still reach the client here.
        return chat_delta_choice(index, {}, reason, self._logprobs(logprobs) if logprobs else None)

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        return chat_choice(
            index, output.text, output.finish_reason, self._logprobs(output.logprobs)
        )

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(entries or [], self.texts)


@dataclass(slots=True)
class CompletionFormat:
    """``text_completion`` choices.

    ``prompt_texts[i]`` is choice ``i``'s prompt, sent first when ``echo``. The
    ``text_offset`` of each choice's logprobs continues from chunk to chunk.
    """

    texts: TokenTexts
    logprobs: bool
    echo: bool
    prompt_texts: dict[int, str]
    chunk_object: str = "text_completion"
    response_object: str = "text_completion"
    _offsets: dict[int, int] = field(default_factory=dict)

    def opening(self, index: int) -> dict[str, Any] | None:
        if not self.echo or not self.prompt_texts.get(index):
            return None
        return completion_choice(index, self.prompt_texts[index], None, None)

    def delta(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        reason: str | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        return completion_choice(index, text, reason, self._logprobs(index, logprobs))

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        return completion_choice(
            index, "", reason, self._logprobs(index, logprobs) if logprobs else None
        )

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        prefix = self.prompt_texts.get(index, "") if self.echo else ""
        return completion_choice(
            index,
            prefix + output.text,
            output.finish_reason,
            self._logprobs(index, output.logprobs),
        )

    def _logprobs(self, index: int, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        start = self._offsets.get(index, 0)
        result = completion_logprobs(entries or [], self.texts, start)
        self._offsets[index] = next_text_offset(result, start)
        return result
