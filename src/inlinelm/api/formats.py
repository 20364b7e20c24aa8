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
from inlinelm.runtime.outputs import CompletionOutput, RequestOutput, TokenLogprobs


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
    ``text_offset`` of each choice's logprobs continues from chunk to chunk. With ``echo``
    and ``logprobs``, the prompt's tokens lead the logprobs (the first one's logprob
    ``null``, as OpenAI's legacy API sends it), so the prompt goes out with the first
    output, once :meth:`note_prompt` has its logprobs. ``prompt_logprobs`` (vLLM's
    extension) adds each choice's ``prompt_logprobs`` list.
    """

    texts: TokenTexts
    logprobs: bool
    echo: bool
    prompt_texts: dict[int, str]
    prompt_logprobs: bool = False
    chunk_object: str = "text_completion"
    response_object: str = "text_completion"
    _offsets: dict[int, int] = field(default_factory=dict)
    # choice index -> (prompt token ids, prompt logprobs), until its first chunk is sent
    _prompts: dict[int, tuple[list[int], list[TokenLogprobs | None]]] = field(default_factory=dict)

    @property
    def echoes_logprobs(self) -> bool:
        """Whether the prompt's logprobs lead the choice's (``echo`` with ``logprobs``)."""
        return self.echo and self.logprobs

    def note_prompt(self, index: int, output: RequestOutput) -> None:
        """Keep the prompt's logprobs of ``output`` for choice ``index``'s first chunk."""
        if output.prompt_logprobs is not None and index not in self._offsets:
            self._prompts[index] = (output.prompt_token_ids, output.prompt_logprobs)

    def opening(self, index: int) -> dict[str, Any] | None:
        if not self.echo or not self.prompt_texts.get(index) or self.echoes_logprobs:
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
        first = index not in self._offsets
        prefix = self.prompt_texts.get(index, "") if first and self.echoes_logprobs else ""
        choice = completion_choice(index, prefix + text, reason, self._logprobs(index, logprobs))
        return self._with_prompt_logprobs(index, choice, first)

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        first = index not in self._offsets
        prefix = self.prompt_texts.get(index, "") if first and self.echoes_logprobs else ""
        shown = (
            self._logprobs(index, logprobs)
            if logprobs or (first and self.echoes_logprobs)
            else None
        )
        return self._with_prompt_logprobs(
            index, completion_choice(index, prefix, reason, shown), first
        )

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        prefix = self.prompt_texts.get(index, "") if self.echo else ""
        choice = completion_choice(
            index,
            prefix + output.text,
            output.finish_reason,
            self._logprobs(index, output.logprobs),
        )
        return self._with_prompt_logprobs(index, choice, True)

    def _logprobs(self, index: int, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        start = self._offsets.get(index, 0)
        if index not in self._offsets and self.echoes_logprobs and index in self._prompts:
            ids, prompt = self._prompts[index]
            result = _prompt_then(
                completion_logprobs([e for e in prompt if e is not None], self.texts, 0),
                self.texts.text(ids[0]),
            )
            start = next_text_offset(result, 0)
            more = completion_logprobs(entries or [], self.texts, start)
            for key in result:
                result[key] += more[key]
        else:
            result = completion_logprobs(entries or [], self.texts, start)
        self._offsets[index] = next_text_offset(result, start if index in self._offsets else 0)
        return result

    def _with_prompt_logprobs(
        self, index: int, choice: dict[str, Any], first: bool
    ) -> dict[str, Any]:
        if self.prompt_logprobs and first and index in self._prompts:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self._prompts[index][1], self.texts)
        return choice


def _prompt_then(prompt: dict[str, Any], first_token: str) -> dict[str, Any]:
    """The prompt's legacy logprobs with its first token (which nothing predicts) before
    them: a ``null`` logprob and ``null`` top logprobs; offsets shifted past it."""
    return {
        "tokens": [first_token, *prompt["tokens"]],
        "token_logprobs": [None, *prompt["token_logprobs"]],
        "top_logprobs": [None, *prompt["top_logprobs"]],
        "text_offset": [0, *(o + len(first_token) for o in prompt["text_offset"])],
    }


def vllm_prompt_logprobs(
    entries: list[TokenLogprobs | None], texts: TokenTexts
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its own id and
    its top ids, each with ``logprob``, ``rank`` (the prompt token's own; 1.. for the top)
    and ``decoded_token``."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = [entry.sampled_rank, *range(1, len(entry.token_ids))]
        out.append(
            {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": texts.text(t)}
                for t, lp, rank in zip(entry.token_ids, entry.logprobs, ranks, strict=True)
            }
        )
    return out
