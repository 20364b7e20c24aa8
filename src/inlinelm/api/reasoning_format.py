"""Chat choices of a reasoning model: its reasoning in ``reasoning_content`` (DeepSeek's
API field, which most clients read) and its answer in ``content``.

:class:`ReasoningChatFormat` wraps a chat's own format (plain, or read for tool calls): the
answer part of each choice's text goes through that format as if it were all the model
wrote, so a tool call written inside the reasoning is no call. Streamed, each choice's text
passes through its own :class:`~inlinelm.reasoning.ReasoningStream`, so a chunk's
``reasoning_content`` and ``content`` are split exactly at the tag however the tokens cut
it, and no tag text reaches either; whole, the answer is split once. With
``include_reasoning: false`` the reasoning is dropped and only the answer is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inlinelm.api.formats import ChoiceFormat
from inlinelm.api.responses import TokenTexts, chat_delta_choice, chat_logprobs
from inlinelm.reasoning import ReasoningParser, ReasoningStream
from inlinelm.runtime.outputs import CompletionOutput, TokenLogprobs


@dataclass(slots=True)
class ReasoningChatFormat:
    """``inner``'s choices with each choice's reasoning split off (see the module
    docstring); ``include``: whether the reasoning is sent; ``logprobs``: whether the client
    asked for them (a chunk of reasoning alone carries its tokens')."""

    inner: ChoiceFormat
    parser: ReasoningParser
    include: bool
    texts: TokenTexts
    logprobs: bool
    _streams: dict[int, ReasoningStream] = field(default_factory=dict)
    chunk_object: str = field(init=False)
    response_object: str = field(init=False)

    def __post_init__(self) -> None:
        self.chunk_object = self.inner.chunk_object
        self.response_object = self.inner.response_object

    def opening(self, index: int) -> dict[str, Any] | None:
        return self.inner.opening(index)

    def delta(
        self, index: int, text: str, logprobs: list[TokenLogprobs] | None, reason: str | None = None
    ) -> dict[str, Any] | None:
        stream = self._streams.setdefault(index, self.parser.stream())
        reasoning, content = stream.feed(text)
        if reason is not None:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return self._choice(index, reasoning, content, logprobs, reason)

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        stream = self._streams.get(index)
        reasoning, content = stream.finish() if stream is not None else ("", "")
        choice = self._choice(index, reasoning, content, logprobs, reason)
        assert choice is not None, "a finish reason always makes a choice"
        return choice

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        split = self.parser.split(output.text)
        choice = self.inner.whole(index, replace(output, text=split.content or ""))
        if split.reasoning is not None and self.include:
            message = choice["message"]
            choice["message"] = {"role": message["role"], "reasoning_content": split.reasoning}
            choice["message"].update(message)
        return choice

    def _choice(
        self,
        index: int,
        reasoning: str,
        content: str,
        logprobs: list[TokenLogprobs] | None,
        reason: str | None,
    ) -> dict[str, Any] | None:
        """One chunk choice of this step's reasoning and answer text; None when neither
        is sent yet (held, or reasoning left out) and the choice goes on."""
        choice = None
        if content:
            choice = self.inner.delta(index, content, logprobs, reason)
        elif reason is not None:
            choice = self.inner.finish(index, reason, logprobs)
        if not reasoning or not self.include:
            return choice
        if choice is None:
            # NOTE: answer text the inner format held keeps its tokens' logprobs for later
            keep = self.logprobs and not content
            formatted = chat_logprobs(logprobs or [], self.texts) if keep else None
            return chat_delta_choice(index, {"reasoning_content": reasoning}, None, formatted)
        choice["delta"] = {"reasoning_content": reasoning, **choice["delta"]}
        return choice
