"""Typed errors raised by inlinelm.

The hierarchy has three kinds, matching what a caller can do about each::

    InlineLMError
    ├── EngineError                  the engine cannot serve anything now (HTTP 503)
    │   ├── EngineDeadError          the engine thread died; every open stream gets it
    │   └── EngineClosedError        the engine was closed by its owner
    ├── RequestFailedError           one request failed; others are unaffected (HTTP 500)
    │   ├── QueueTimeoutError        it waited longer than max_queue_wait_s
    │   └── SlowConsumerError        its reader fell too far behind
    ├── RequestError (ValueError)    the request itself is bad (HTTP 400)
    │   └── QueueFullError           admission refused it (HTTP 429)
    ├── ConfigError (ValueError)     an engine option is unknown, invalid, or does not fit
    │                                this machine (device, memory); names the option
    └── ModelLoadError (ValueError)  a model or its files cannot be loaded
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class InlineLMError(Exception):
    """Base class of every error inlinelm raises on purpose."""


class EngineError(InlineLMError):
    """The engine as a whole cannot serve requests."""


class EngineDeadError(EngineError):
    """The engine thread died; the original error is attached as ``__cause__``."""


class EngineClosedError(EngineError):
    """The engine was closed; start a new one."""


class RequestFailedError(InlineLMError):
    """One request failed while it ran; the engine and other requests go on."""


class QueueTimeoutError(RequestFailedError):
    """The request waited in the queue longer than ``max_queue_wait_s``."""


class SlowConsumerError(RequestFailedError):
    """The stream's reader fell behind by more than ``max_stream_backlog_bytes``."""


class RequestError(InlineLMError, ValueError):
    """The request is invalid; ``param`` names the offending field when there is one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class QueueFullError(RequestError):
    """Admission control refused the request; retry later."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ConfigError(InlineLMError, ValueError):
    """An engine option is unknown or invalid, or the machine cannot honour it; ``option``
    names it (the message says what to change)."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.option = option


class ModelLoadError(InlineLMError, ValueError):
    """A model cannot be loaded; names the file and, when known, the field."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None) -> None:
        parts = [message]
        if path is not None:
            parts.append(f"file: {path}")
        if field is not None:
            parts.append(f"field: {field}")
        super().__init__(" | ".join(parts))
        self.path = path
        self.field = field


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to a misspelt ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
