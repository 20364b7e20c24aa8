"""Admission: what a request must pass before anything is queued for the engine thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inlinelm.config import EngineConfig
from inlinelm.errors import RequestError
from inlinelm.sampling_params import SamplingParams


def check_limits(config: EngineConfig, params: SamplingParams) -> None:
    """The engine's own caps on what one request may ask for."""
    if params.n > config.max_n:
        raise RequestError(f"n must be at most {config.max_n} on this engine", param="n")
    if params.logprobs is not None and params.logprobs > config.max_logprobs:
        raise RequestError(
            f"logprobs must be at most {config.max_logprobs} on this engine", param="logprobs"
        )
    if params.prompt_logprobs is not None and params.prompt_logprobs > config.max_logprobs:
        raise RequestError(
            f"prompt_logprobs must be at most {config.max_logprobs} on this engine",
            param="prompt_logprobs",
        )
    check_stop_limits(config, params.stop)


def check_stop_limits(config: EngineConfig, stop: Sequence[str]) -> None:
    """At most ``max_stop_strings`` stop strings, none longer than ``max_stop_string_chars``:
    every choice matches them against its text on the event loop."""
    if len(stop) > config.max_stop_strings:
        raise RequestError(
            f"at most {config.max_stop_strings} stop strings are allowed on this engine, "
            f"got {len(stop)}",
            param="stop",
        )
    longest = max(map(len, stop), default=0)
    if longest > config.max_stop_string_chars:
        raise RequestError(
            f"stop strings may be at most {config.max_stop_string_chars} characters long "
            f"on this engine, got one of {longest}",
            param="stop",
        )


@dataclass(slots=True)
class Admission:
    """Tokenizes prompts and checks them against the context before anything is queued."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    # What a chat's and a completion's unset sampling fields take
    # (EngineConfig.sampling_defaults; they differ in the fallback max_tokens only).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    completion_defaults: dict[str, Any] = field(default_factory=dict)

    def with_defaults(
        self, params: SamplingParams, num_prompt_tokens: int, *, chat: bool = True
    ) -> SamplingParams:
        """``params`` with its unset fields filled from a chat's or a completion's defaults;
        a default ``max_tokens`` is cut to the room the prompt leaves (an explicit one is
        checked by :meth:`check_lengths` instead)."""
        if not params.unset_fields:
            return params
        defaults = self.defaults(chat=chat)
        if "max_tokens" in params.unset_fields and "max_tokens" in defaults:
            room = max(1, self.max_model_len - num_prompt_tokens)
            defaults = {**defaults, "max_tokens": min(defaults["max_tokens"], room)}
        return params.with_defaults(defaults)

    def defaults(self, *, chat: bool) -> dict[str, Any]:
        """A chat's or a completion's defaults (the chat's when no completion's were given)."""
        if chat or not self.completion_defaults:
            return self.sampling_defaults
        return self.completion_defaults

    def tokenize(
        self, prompt: str | list[int], add_special_tokens: bool, param: str = "prompt"
    ) -> list[int]:
        """Token ids of ``prompt``; raises ``RequestError`` for an empty or invalid prompt."""
        if isinstance(prompt, str):
            ids = encode(self.tokenizer, prompt, add_special_tokens, param)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)  # NOTE: owned: the caller may reuse its list
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise RequestError(
                    f"prompt token ids must be in [0, {self.vocab_size})", param=param
                )
        else:
            raise RequestError("prompt must be a string or a list of token ids", param=param)
        if not ids:
            raise RequestError("the prompt is empty", param=param)
        return ids

    def check_lengths(
        self, prompt_ids: list[int], params: SamplingParams, param: str = "prompt"
    ) -> int:
        """The effective max_tokens; raises ``RequestError`` when prompt + output cannot fit."""
        self.check_token_ids(params)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens",
                param=param,
            )
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion)",
                param="max_tokens",
            )
        return params.max_tokens if params.max_tokens is not None else room

    def check_token_ids(self, params: SamplingParams) -> None:
        """Every token id ``params`` carries (stop_token_ids, logit_bias keys) is in the
        vocabulary; the engine thread indexes logits with them unchecked."""
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias.keys()),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"invalid {name}: token id {bad[0]} is outside the vocabulary "
                    f"(size {self.vocab_size})",
                    param=name,
                )


def encode(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """``tokenizer.encode(text)``; text that cannot be tokenized (a lone surrogate) is a
    ``RequestError`` naming ``param``."""
    try:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as e:
        raise RequestError(f"cannot tokenize the {param}: {type(e).__name__}", param=param) from e
    return ids
