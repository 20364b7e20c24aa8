"""Where a request's prompt comes from: text, token ids, or chat messages to render."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inlinelm.errors import RequestError

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class PromptSource:
    """A request's input as the caller gave it: a prompt (text or token ids), or chat
    ``messages`` (and ``tools``) to render through the chat template; how to tokenize it,
    and the field named when it is bad."""

    prompt: Prompt | None
    messages: Sequence[dict[str, Any]] | None
    tools: Sequence[dict[str, Any]] | None
    add_special_tokens: bool
    # Characters of text to render and tokenize (token ids count one each; a server may
    # give its whole request's size): past ``max_inline_prompt_chars`` that work runs on a
    # worker thread.
    size: int
    # A chat's template variables (the engine's defaults updated by the request's own).
    template_kwargs: Mapping[str, Any] | None = None

    @classmethod
    def of_prompt(cls, prompt: Prompt, add_special_tokens: bool, size: int) -> PromptSource:
        """A completion's prompt, tokenized as given."""
        return cls(prompt, None, None, add_special_tokens, size)

    @classmethod
    def of_chat(
        cls,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        size: int,
        add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> PromptSource:
        """A chat, rendered through the chat template (which adds the special tokens)
        with ``template_kwargs`` as its variables."""
        return cls(None, messages, tools, add_special_tokens, size, template_kwargs)

    @property
    def is_chat(self) -> bool:
        """Rendered from messages (a chat), not the caller's prompt (a completion)."""
        return self.messages is not None

    @property
    def param(self) -> str:
        """The request field a bad input is reported against."""
        return "messages" if self.is_chat else "prompt"

    def make(self, tokenizer: Any) -> Prompt:
        """The prompt to tokenize: the caller's, or the rendered chat."""
        if self.messages is not None:
            return render_chat(tokenizer, self.messages, self.tools, self.template_kwargs)
        assert self.prompt is not None
        return self.prompt


def prompt_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """``generate``'s prompts as a list: one prompt (text or token ids), or a list of them."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]  # one prompt: text or token ids
    return list(prompts)  # type: ignore[arg-type]  # a list of prompts


def conversation_batch(
    conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
) -> list[Sequence[dict[str, Any]]]:
    """``generate_chat``'s conversations as a list: one conversation (a list of messages),
    or a list of them."""
    if conversations and isinstance(conversations[0], dict):
        return [conversations]  # type: ignore[list-item]  # one conversation: messages
    return list(conversations)  # type: ignore[arg-type]  # a list of conversations


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text the chat template makes of ``messages`` (with the assistant turn
    opened), of ``tools`` when given (``apply_chat_template(..., tools=...)``) and with
    ``template_kwargs`` as template variables; a template that fails is a
    ``RequestError`` naming ``messages``, its message the template's error."""
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception as e:
        raise RequestError(f"cannot apply the chat template: {e}", param="messages") from e
    return str(text)


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
