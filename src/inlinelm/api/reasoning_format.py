"""Chat choices of a reasoning model: its reasoning in ``reasoning_content`` (DeepSeek's
API field, which most clients read) and its answer in ``content``.

The engine splits each choice's text as it is released (a chat submitted with a
reasoning parser: ``CompletionOutput.reasoning`` beside the answer's ``text``, split
exactly at the tags however the tokens cut them, with no tag text in either).
:class:`ReasoningChatFormat` wraps a chat's own format (plain, or read for tool calls): the
answer goes through that format as if it were all the model wrote, so a tool call written
inside the reasoning is no call, and the reasoning goes out beside it. With
``include_reasoning: false`` the reasoning is dropped and only the answer is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inlinelm.api.formats import ChoiceFormat
from inlinelm.api.responses import TokenTexts, chat_delta_choice, chat_logprobs
from inlinelm.runtime.outputs import CompletionOutput, TokenLogprobs


@dataclass(slots=True)
class ReasoningChatFormat:
    """``inner``'s choices with each choice's reasoning beside its answer (see the module
    docstring); ``include``: whether the reasoning is sent; ``logprobs``: whether the client
    asked for them (a chunk of reasoning alone carries its tokens')."""

    inner: ChoiceFormat
    include: bool
    texts: TokenTexts
    logprobs: bool
    chunk_object: str = field(init=False)
    response_object: str = field(init=False)

    def __post_init__(self) -> None:
        self.chunk_object = self.inner.chunk_object
        self.response_object = self.inner.response_object

    def opening(self, index: int) -> dict[str, Any] | None:
        return self.inner.opening(index)

    def delta(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        reason: str | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any] | None:
        choice = None
        if text:
            choice = self.inner.delta(index, text, logprobs, reason)
        elif reason is not None:
            choice = self.inner.finish(index, reason, logprobs)
        if not reasoning or not self.include:
            return choice
        if choice is None:
            # NOTE: answer text the inner format held keeps its tokens' logprobs for later
            keep = self.logprobs and not text
            formatted = chat_logprobs(logprobs or [], self.texts) if keep else None
            return chat_delta_choice(index, {"reasoning_content": reasoning}, None, formatted)
        choice["delta"] = {"reasoning_content": reasoning, **choice["delta"]}
        return choice

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        return self.inner.finish(index, reason, logprobs)

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        choice = self.inner.whole(index, replace(output, reasoning=None))
        if output.reasoning is not None and self.include:
            message = choice["message"]
            choice["message"] = {"role": message["role"], "reasoning_content": output.reasoning}
            choice["message"].update(message)
        return choice
