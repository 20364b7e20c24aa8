"""Per-request sampling and output settings."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from inlinelm.errors import RequestError, did_you_mean
from inlinelm.structured.spec import StructuredOutput

# What ``torch.Generator.manual_seed`` takes: an int64 or a uint64.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class _Unset:
    """The default of a field the caller left to the engine."""

    def __repr__(self) -> str:
        return "<engine default>"


UNSET: Any = _Unset()
"""Default of the fields an engine fills from its sampling defaults (``ENGINE_DEFAULTED``)."""

UNSET_VALUES: Mapping[str, Any] = {
    "max_tokens": 16,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
"""What an unset field reads as outside an engine (the sampler and scheduler used alone)."""

ENGINE_DEFAULTED = tuple(UNSET_VALUES)
"""The fields an engine fills, when the caller leaves them unset, from the model's
``generation_config.json`` and its ``default_*`` options."""


class LogitBias(dict[int, float]):
    """``SamplingParams.logit_bias``: a dict that refuses changes once made, so a request's
    params can be shared with the engine thread without a copy."""

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("SamplingParams.logit_bias cannot be changed: derive new params")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> tuple[type[LogitBias], tuple[dict[int, float]]]:
        return (LogitBias, (dict(self),))

    def __copy__(self) -> LogitBias:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> LogitBias:
        return self


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

    Engine defaults: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` (``ENGINE_DEFAULTED``) that the caller does not set are filled by
    the engine at submit, from the model's ``generation_config.json`` and the engine's
    ``default_*`` options (see :meth:`inlinelm.Engine.default_sampling_params`); values the
    caller sets always win. :attr:`unset_fields` names the fields left to the engine; read
    outside an engine they hold ``UNSET_VALUES`` (max_tokens 16, temperature 1.0, …).
    ``max_tokens=None`` set explicitly means "up to the end of the context".

    Immutable: fields cannot be reassigned, ``stop`` and ``stop_token_ids`` are stored as
    tuples and ``logit_bias`` as a read-only dict, each a copy of what the caller passed,
    so nothing the caller still holds reaches the engine thread and the engine shares the
    params it was given. Validated once, when made; use :meth:`with_overrides` to derive
    (``dataclasses.replace`` would mark every field as set).

    ``n`` and ``logprobs`` are checked for their type and sign here; the most one request
    may ask for is the engine's rule (``EngineConfig.max_n``, ``max_logprobs``), checked
    when the request is submitted.
    """

    n: int = 1
    max_tokens: int | None = UNSET
    min_tokens: int = 0
    temperature: float = UNSET
    top_p: float = UNSET
    top_k: int = UNSET
    min_p: float = UNSET
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = UNSET
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens (vLLM's prompt_logprobs): each prompt token's
    # after the first, with this many top alternatives; computed during prefill.
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=LogitBias)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.DELTA
    stream_interval: int | None = None
    priority: int = 0
    # Constrain the output (JSON Schema, JSON object, regex, choice, grammar).
    structured: StructuredOutput | None = None
    _unset: frozenset[str] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        # NOTE: frozen, so normalising goes through object.__setattr__; containers are copied.
        unset = frozenset(name for name in ENGINE_DEFAULTED if getattr(self, name) is UNSET)
        for name in unset:
            object.__setattr__(self, name, UNSET_VALUES[name])
        object.__setattr__(self, "_unset", unset)
        stop = (self.stop,) if isinstance(self.stop, str) else _tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _tuple(self.stop_token_ids, "stop_token_ids"))
        if not isinstance(self.logit_bias, dict):
            raise RequestError("invalid logit_bias: must be a dict", param="logit_bias")
        if type(self.logit_bias) is not LogitBias:
            object.__setattr__(self, "logit_bias", LogitBias(self.logit_bias))
        if isinstance(self.output_kind, str):
            object.__setattr__(self, "output_kind", _parse_output_kind(self.output_kind))
        self._validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def __repr__(self) -> str:
        shown = (
            f"{name}={UNSET if name in self._unset else getattr(self, name)!r}"
            for name in _init_names()
        )
        return f"SamplingParams({', '.join(shown)})"

    @property
    def unset_fields(self) -> frozenset[str]:
        """The engine-defaulted fields the caller did not set (the engine fills them)."""
        return self._unset

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again); fields left unset stay unset
        unless overridden. An unknown name raises ``RequestError`` with a "did you mean"."""
        names = _init_names()
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            name = unknown[0]
            raise RequestError(
                f"unknown sampling parameter {name!r}{did_you_mean(name, names)}", param=name
            )
        values = {name: getattr(self, name) for name in names if name not in self._unset}
        values.update(overrides)
        return SamplingParams(**values)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """A copy whose unset fields take their value from ``defaults`` (the fields it names);
        ``self`` when there is nothing to fill.

        ``defaults`` are an engine's sampling defaults, each checked when the engine
        loaded (``EngineConfig.sampling_defaults``), so only the rule that ties a default
        to the caller's own fields is checked again: min_tokens <= max_tokens."""
        fill = {name: defaults[name] for name in self._unset if name in defaults}
        if not fill:
            return self
        filled = self._derive(fill, self._unset - fill.keys())
        max_tokens = filled.max_tokens
        _check(
            max_tokens is None or "max_tokens" in filled._unset or filled.min_tokens <= max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        return filled

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice ``index`` of an ``n > 1`` request: ``n=1``, and its own seed
        (``seed + index``, which validation already held within range)."""
        seed = None if self.seed is None else self.seed + index
        return self._derive({"n": 1, "seed": seed}, self._unset)

    def copy(self) -> SamplingParams:
        """``self``: params are immutable, so a copy would be the same value."""
        return self

    def _derive(self, changes: Mapping[str, Any], unset: Iterable[str]) -> SamplingParams:
        """A copy with ``changes`` (values known to be valid) and ``unset`` as its unset
        fields, not validated again."""
        derived: SamplingParams = object.__new__(SamplingParams)
        for name in _init_names():
            object.__setattr__(derived, name, changes.get(name, getattr(self, name)))
        object.__setattr__(derived, "_unset", frozenset(unset))
        return derived

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "must be a positive int")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be a positive int or None",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0"
        )
        _check(
            self.max_tokens is None
            or "max_tokens" in self._unset
            or self.min_tokens <= self.max_tokens,
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
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs",
            "must be an int >= 0 or None",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            "must be an int >= 0 or None",
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
        _check(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            "structured",
            "must be a StructuredOutput or None",
        )


@functools.cache
def _init_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(SamplingParams) if f.init)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tuple(value: object, name: str) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
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
