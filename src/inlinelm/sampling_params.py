"""Per-request sampling and output settings."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

from inlinelm.errors import RequestError

_MAX_LOGPROBS = 20
# What ``torch.Generator.manual_seed`` takes: an int64 or a uint64.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class OutputKind(enum.Enum):
    """How a stream reports progress: new text only, all text so far, or only the end."""

    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate and how to report it.

    Invalid values raise :class:`~inlinelm.errors.RequestError` (a ``ValueError``) at
    construction, naming the field. ``temperature == 0`` means greedy decoding.

    Immutable: fields cannot be reassigned, and the list and dict fields are copies of what
    the caller passed, so nothing the caller still holds reaches the engine thread (the
    engine also takes its own :meth:`copy` at submit). Use :meth:`with_overrides` to derive.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.DELTA
    stream_interval: int | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        # NOTE: frozen, so normalising goes through object.__setattr__; containers are copied.
        stop = [self.stop] if isinstance(self.stop, str) else _copy_list(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(
            self, "stop_token_ids", _copy_list(self.stop_token_ids, "stop_token_ids")
        )
        if not isinstance(self.logit_bias, dict):
            raise RequestError("invalid logit_bias: must be a dict", param="logit_bias")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if isinstance(self.output_kind, str):
            object.__setattr__(self, "output_kind", _parse_output_kind(self.output_kind))
        self._validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        unknown = set(overrides) - set(self.__dataclass_fields__)
        if unknown:
            name = sorted(unknown)[0]
            raise RequestError(f"unknown sampling parameter {name!r}", param=name)
        return replace(self, **overrides)

    def copy(self) -> SamplingParams:
        """An independent copy (its lists and dict are new objects)."""
        return replace(self)

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "must be an int in [1, 128]")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be a positive int or None",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0"
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        _check(
            _finite(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            "must be in [0, 100]",
        )
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "must be -1, 0 (off) or positive",
        )
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(
            _finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            "must be in (0, 10]",
        )
        _check(
            self.seed is None
            or (
                _is_int(self.seed) and self.seed >= MIN_SEED and self.seed + self.n - 1 <= MAX_SEED
            ),
            "seed",
            f"must be an int in [{MIN_SEED}, {MAX_SEED}] (with n > 1, seed + n - 1 too) or None",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be token ids",
        )
        _check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= _MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {_MAX_LOGPROBS}] or None",
        )
        _check(
            all(
                isinstance(k, int) and k >= 0 and _finite(v) and -100 <= v <= 100
                for k, v in self.logit_bias.items()
            ),
            "logit_bias",
            "must map token ids to values in [-100, 100]",
        )
        _check(
            self.stream_interval is None
            or (isinstance(self.stream_interval, int) and self.stream_interval >= 1),
            "stream_interval",
            "must be a positive int or None",
        )
        _check(isinstance(self.priority, int), "priority", "must be an int")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _copy_list(value: object, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise RequestError(f"invalid {name}: must be a list", param=name)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise RequestError(f"invalid {name}: {why}", param=name)


def _parse_output_kind(value: str) -> OutputKind:
    try:
        return OutputKind(value)
    except ValueError:
        raise RequestError(f"invalid output_kind: {value!r}", param="output_kind") from None
