"""Response objects of the OpenAI-compatible API, built as plain dicts in OpenAI's exact shape.

Streams use ``chat.completion.chunk`` / ``text_completion`` chunks; whole answers use
``chat.completion`` / ``text_completion``. Logprobs come in the two OpenAI forms: chat's
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and the legacy
completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from inlinelm.runtime.outputs import TokenLogprobs


def new_id(prefix: str) -> str:
    """A fresh response id, ``chatcmpl-…`` or ``cmpl-…`` as at OpenAI."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's ``usage`` object; a reasoning model's chat (``reasoning_tokens`` given)
    also says how many of the completion's tokens were its reasoning."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


class TokenTexts:
    """Token id → (text, UTF-8 bytes), cached, for the logprobs objects.

    A token that ends inside a UTF-8 character decodes to U+FFFD; OpenAI's ``bytes`` field
    exists for exactly that case, and clients join the bytes of consecutive tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("utf-8"))


@dataclass(slots=True)
class ResponseHeader:
    """The fields every chunk and response of one request shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    # With include_usage every chunk carries ``"usage": null`` but the last (OpenAI's shape).
    include_usage: bool = False

    def chunk(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A stream chunk holding ``choices``."""
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(
        self,
        object_name: str,
        prompt_tokens: int,
        completion_tokens: int,
        reasoning_tokens: int | None = None,
    ) -> dict[str, Any]:
        """The one chunk with empty ``choices`` and the request's usage."""
        chunk = self.chunk(object_name, [])
        chunk["usage"] = usage(prompt_tokens, completion_tokens, reasoning_tokens)
        return chunk

    def response(
        self, object_name: str, choices: list[dict[str, Any]], usage_: dict[str, Any]
    ) -> dict[str, Any]:
        """A whole (non-streamed) response."""
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_,
        }


# --- chat -------------------------------------------------------------------------------


def chat_delta_choice(
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a ``chat.completion.chunk``."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """One choice of a ``chat.completion``."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    """Chat's logprobs object for some positions (index 0 of each entry is the sampled token)."""
    return {"content": [_chat_logprob(entry, texts) for entry in entries]}


def _chat_logprob(entry: TokenLogprobs, texts: TokenTexts) -> dict[str, Any]:
    top = [
        {"token": texts.text(t), "logprob": lp, "bytes": texts.bytes(t)}
        for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
    ]
    sampled = entry.token_ids[0]
    return {
        "token": texts.text(sampled),
        "logprob": entry.logprobs[0],
        "bytes": texts.bytes(sampled),
        "top_logprobs": top,
    }


# --- completions ------------------------------------------------------------------------


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """One choice of a ``text_completion`` (chunk or whole response: the shape is the same)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_logprobs(
    entries: list[TokenLogprobs], texts: TokenTexts, text_offset: int
) -> dict[str, Any]:
    """The legacy logprobs object; ``text_offset`` is where the first token starts in the text.

    ``top_logprobs`` maps token text to logprob for the top-N plus the sampled token, as
    OpenAI's legacy API does (so up to N + 1 entries).
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token = texts.text(entry.token_ids[0])
        tokens.append(token)
        token_logprobs.append(entry.logprobs[0])
        top = {
            texts.text(t): lp for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
        }
        top.setdefault(token, entry.logprobs[0])
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def next_text_offset(logprobs: dict[str, Any], start: int) -> int:
    """Where the token after ``logprobs``' last one starts (to continue ``text_offset``)."""
    tokens: list[str] = logprobs["tokens"]
    return start + sum(len(t) for t in tokens)
