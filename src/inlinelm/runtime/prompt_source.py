"""Where a request's prompt comes from: text, token ids, or chat messages to render."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class PromptSource:
    """A prompt to make (render a chat, or return the caller's prompt), how to tokenize it,
    and the field named when it is bad."""

    make: Callable[[], Prompt]
    add_special_tokens: bool
    param: str
    # Characters of text to render and tokenize (0 for token ids): past
    # ``max_inline_prompt_chars`` that work runs on a worker thread.
    size: int


def chat_size(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of text in ``messages`` (string contents and text parts)."""
    size = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(
                len(p["text"])
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return size
