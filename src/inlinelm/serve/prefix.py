"""Prefix affinity: which replica should serve a request, so that its prompt's prefix is cached.

Replicas keep a prefix cache of KV blocks. A router that spreads requests at random makes
every replica compute the same system prompt; routing every request that shares a prefix
to one replica computes it once. Two pure functions, with no Ray in them:

- :func:`prefix_key` reads an OpenAI request body and returns the text its prompt is
  expected to share with others: a chat's leading system (or developer) messages, else its
  first user turn (so every turn of one conversation lands on the same replica); a
  completion's first ``prefix_chars`` characters (for a prompt of token ids, its first
  ``prefix_chars // 4`` ids: about as many tokens as that many characters hold).
- :func:`choose` picks a replica for a key by rendezvous hashing (highest random weight):
  adding a replica moves to it only the keys it now wins, and losing one moves only the
  keys it held. The load bound keeps one hot prefix
  from swamping its replica: when the preferred replica holds more than ``max_imbalance``
  requests above the mean, the request goes to the least-loaded replica instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

DEFAULT_PREFIX_CHARS = 1024
DEFAULT_MAX_IMBALANCE = 8.0
_SHARED_ROLES = ("system", "developer")


def prefix_key(path: str, body: bytes, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """The prompt prefix that ``body`` (an OpenAI request to ``path``) is expected to share.

    None when the body names no prompt (not JSON, another endpoint, a malformed field):
    such a request is routed by load alone, and the replica answers it (with a 400 if it
    is bad), so routing never second-guesses validation.
    """
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(request, dict):
        return None
    if path.endswith("/chat/completions"):
        return _chat_key(request.get("messages"), prefix_chars)
    if path.endswith("/completions"):
        return _completion_key(request.get("prompt"), prefix_chars)
    return None


def _chat_key(messages: Any, prefix_chars: int) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    shared = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in _SHARED_ROLES:
            break
        shared.append(_text(message.get("content")))
    if not shared:
        first_user = next(
            (m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None
        )
        if first_user is None:
            return None
        shared.append(_text(first_user.get("content")))
    return "\x00".join(shared)[:prefix_chars]


def _completion_key(prompt: Any, prefix_chars: int) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # NOTE: a batch of prompts is routed by its first one
    if isinstance(prompt, str):
        return prompt[:prefix_chars] or None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt[: max(1, prefix_chars // 4)]))
    return None


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def rank(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` in order of preference for ``key`` (rendezvous hashing)."""
    return sorted(replicas, key=lambda replica: _weight(key, replica), reverse=True)


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose(
    key: str | None,
    loads: Mapping[str, float],
    max_imbalance: float = DEFAULT_MAX_IMBALANCE,
) -> str:
    """The replica (a key of ``loads``, its queued and running requests) to serve ``key``.

    The key's preferred replica, unless it holds more than ``max_imbalance`` requests above
    the mean load; then, as for a request with no key, the least-loaded replica (ties go
    to the key's preference, so equal loads still keep a prefix in one place).
    """
    if not loads:
        raise ValueError("no replica to choose from")
    replicas = sorted(loads)
    order = rank(key, replicas) if key is not None else replicas
    preferred = order[0]
    mean = sum(loads.values()) / len(loads)
    if key is not None and loads[preferred] <= mean + max_imbalance:
        return preferred
    return min(order, key=lambda replica: loads[replica])
