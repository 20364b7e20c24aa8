"""What the sched tests build their requests with."""

from __future__ import annotations

from typing import Any

from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request


def make_request(
    request_id: str, prompt: list[int], *, eos_token_id: int | None = None, **params: Any
) -> Request:
    """A request for ``prompt`` with ``SamplingParams(**params)``; with no ``eos_token_id``
    the scheduler gives it its own when it is added."""
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=eos_token_id)
