"""Why a request stopped (a module of its own: requests and output records both name it)."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    """Why a request stopped: OpenAI's ``finish_reason`` values plus ``error``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
