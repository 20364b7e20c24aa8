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
    # Characters of text to render and tokenize (token ids count one each; a server may
    # give its whole request's size): past ``max_inline_prompt_chars`` that work runs on a
    # worker thread.
    size: int

    @property
    def is_chat(self) -> bool:
        """Rendered from messages (a chat), not the caller's prompt (a completion)."""
        return self.param == "messages"


def chat_size(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    limit: int = 0,
) -> int:
    """Characters of text in ``messages`` (string contents and text parts) and in
    ``tools`` (every string in them: names, descriptions, schemas), counted up to just past
    ``limit`` when one is given (the caller only asks whether the input is larger)."""
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
        if limit and size > limit:
            return size
    return size + text_size(tools, limit - size if limit else 0) if tools else size


def text_size(value: Any, limit: int = 0) -> int:
    """Characters in every string (keys included) inside ``value``, walked without
    recursion, and stopped just past ``limit`` when one is given."""
    size = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
            if limit and size > limit:
                break
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return size
