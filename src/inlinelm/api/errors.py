"""OpenAI-shaped HTTP errors, and the mapping from inlinelm's typed errors to them.

Every error the router answers has the body ``{"error": {"message", "type", "param",
"code"}}``, exactly as OpenAI's API sends it, so clients raise their usual exceptions:

=================================  ======  =========================  ==================
inlinelm error                     status  type                       code
=================================  ======  =========================  ==================
``RequestError`` (bad field)       400     ``invalid_request_error``  ``invalid_value``
``QueueFullError``                 429     ``rate_limit_error``       ``queue_full``
``EngineDeadError``                503     ``server_error``           ``engine_dead``
``EngineClosedError``              503     ``server_error``           ``engine_closed``
``QueueTimeoutError``              503     ``server_error``           ``queue_timeout``
``SlowConsumerError``              500     ``server_error``           ``slow_consumer``
other ``RequestFailedError``       500     ``server_error``           ``request_failed``
=================================  ======  =========================  ==================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from inlinelm.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineError,
    QueueFullError,
    QueueTimeoutError,
    RequestError,
    RequestFailedError,
    SlowConsumerError,
)


@dataclass
class APIError(Exception):
    """An error the router answers with an OpenAI error body and ``status``.

    ``headers`` carries extra response headers (``Retry-After`` for 429 and 503).
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)

    def body(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``.

        Message and param may quote what the client sent; a lone surrogate in them is
        escaped (``\\ud800``) so the body can always be encoded.
        """
        return {
            "error": {
                "message": _encodable(self.message),
                "type": self.type,
                "param": None if self.param is None else _encodable(self.param),
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """A JSON response carrying :meth:`body`, the status and the extra headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 ``invalid_request_error`` naming the offending field."""
    return APIError(400, message, param=param, code=code)


def from_exception(exc: BaseException) -> APIError:
    """Map an inlinelm error to its HTTP form; anything else becomes a 500 ``server_error``.

    The message of an unexpected exception is not leaked to the client (it may hold
    internals); the caller logs it.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            exc.message,
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": _retry_after(exc.retry_after_s)},
        )
    if isinstance(exc, RequestError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, EngineError):
        return _engine_unavailable(exc)
    if isinstance(exc, RequestFailedError):
        return _request_failed(exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def _engine_unavailable(exc: EngineError) -> APIError:
    if isinstance(exc, EngineDeadError):
        # NOTE: the cause's message may hold internals; clients get its class only.
        cause = exc.__cause__
        message = "the engine died" + (f": {type(cause).__name__}" if cause is not None else "")
        return APIError(503, message, type="server_error", code="engine_dead")
    code = "engine_closed" if isinstance(exc, EngineClosedError) else "engine_unavailable"
    return APIError(503, str(exc) or code, type="server_error", code=code)


def _request_failed(exc: RequestFailedError) -> APIError:
    message = str(exc) or type(exc).__name__
    if isinstance(exc, QueueTimeoutError):
        # NOTE: a queue timeout is overload, not a bug: 503 tells clients to retry.
        return APIError(
            503, message, type="server_error", code="queue_timeout", headers={"Retry-After": "1"}
        )
    code = "slow_consumer" if isinstance(exc, SlowConsumerError) else "request_failed"
    return APIError(500, message, type="server_error", code=code)


def _encodable(text: str) -> str:
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _retry_after(seconds: float) -> str:
    """``Retry-After`` takes whole seconds; round up so a client never retries too early."""
    return str(max(1, math.ceil(seconds)))
