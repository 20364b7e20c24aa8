"""The parsing tests' bodies and refusals (no engine, no server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from inlinelm.api.errors import APIError
from inlinelm.api.protocol import Limits, parse_chat, parse_completion

LIMITS = Limits()
USER = [{"role": "user", "content": "hi"}]

Parse = Callable[[Any, Limits], Any]


def chat(**fields: Any) -> dict[str, Any]:
    """A chat completions body: one user message, and ``fields``."""
    return {"messages": USER, **fields}


def refused(body: Any, parse: Parse | None = None) -> APIError:
    """The 400 that parsing ``body`` raises; ``parse`` defaults to the chat parser for a body
    with ``messages`` and the completions parser for any other."""
    if parse is None:
        parse = parse_chat if "messages" in body else parse_completion
    with pytest.raises(APIError) as info:
        parse(body, LIMITS)
    assert info.value.status == 400
    return info.value
