"""Chat-template control: a template of the caller's own in place of the tokenizer's, and
the keyword arguments a template is rendered with (Qwen3's ``enable_thinking``, a
``reasoning_effort``, any variable a template reads).

A template given as text is used as is; one given as a path is read from that file. The
keyword arguments are the engine's defaults (``default_chat_template_kwargs``) updated by a
request's own (``chat_template_kwargs``); the names ``apply_chat_template`` itself takes are
refused, since a template variable of that name would silently change how the chat is
rendered, not what the template reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inlinelm.errors import RequestError

RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def looks_like_template(value: str) -> bool:
    """Whether ``value`` is a template's text (it holds a Jinja tag), not a file's path."""
    return "{{" in value or "{%" in value


def read_chat_template(value: str) -> str:
    """The template ``value`` names: its own text, or the text of the file it is the path
    of (``OSError`` when that cannot be read, ``ValueError`` when it holds no template)."""
    if looks_like_template(value):
        return value
    text = Path(value).expanduser().read_text(encoding="utf-8")
    if not looks_like_template(text):
        raise ValueError(f"{value} holds no Jinja template (no '{{{{' or '{{%')")
    return text


def template_kwargs_error(kwargs: object) -> str | None:
    """Why ``kwargs`` cannot be a chat template's keyword arguments, or None when it can:
    an object whose keys are strings, none of them a name ``apply_chat_template`` takes."""
    if not isinstance(kwargs, Mapping):
        return f"must be an object of template variables, got {type(kwargs).__name__}"
    for key in kwargs:
        if not isinstance(key, str):
            return f"keys must be strings, got {key!r}"
        if key in RESERVED_KWARGS:
            return f"{key!r} is not a template variable: apply_chat_template takes it itself"
    return None


def chat_kwargs(
    defaults: Mapping[str, Any] | None, request: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A chat's template variables: the engine's defaults updated by the request's own (a
    ``RequestError`` naming ``chat_template_kwargs`` for ones that cannot be)."""
    if request is not None:
        why = template_kwargs_error(request)
        if why is not None:
            raise RequestError(f"chat_template_kwargs {why}", param="chat_template_kwargs")
    merged = dict(defaults or {})
    merged.update(request or {})
    return merged
