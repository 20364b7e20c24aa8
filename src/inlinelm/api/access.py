"""Who may call the API: an optional bearer key, and bodies declared as JSON.

With an API key, every endpoint but ``/health`` wants ``Authorization: Bearer <key>``
(what OpenAI clients send); a missing or wrong key is a 401 with ``WWW-Authenticate:
Bearer``. The key is compared in constant time.

Every endpoint that reads a body wants ``Content-Type: application/json`` (or an
``application/*+json`` type), key or no key. A browser sends a cross-site POST without
asking first only when its type is ``text/plain``, a form, or missing; refusing all
three (415) means a web page cannot drive a local server through its visitors' browsers.
curl users add ``-H 'content-type: application/json'``, as OpenAI's own examples do.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from inlinelm.api.errors import APIError

Endpoint = Callable[[Request], Awaitable[Response]]


class Access:
    """The checks in front of every endpoint of one router."""

    def __init__(self, api_key: str | None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string, or None for no key")
        self._key = None if api_key is None else api_key.encode("utf-8")

    def guard(self, endpoint: Endpoint, *, needs_key: bool = True, json_body: bool) -> Endpoint:
        """``endpoint`` behind the key check (when ``needs_key``) and the JSON-body check."""

        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            try:
                if needs_key:
                    self.check_key(request)
                if json_body:
                    check_json_body(request)
            except APIError as error:
                return error.response()
            return await endpoint(request)

        return guarded

    def check_key(self, request: Request) -> None:
        """A 401 unless the request carries the key (a no-op when there is none)."""
        if self._key is None:
            return
        presented = _bearer_token(request)
        if presented is None:
            raise _unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(presented, self._key):
            raise _unauthorized("incorrect API key")


def check_json_body(request: Request) -> None:
    """A 415 unless the body is declared as JSON."""
    declared = request.headers.get("content-type")
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        return
    raise APIError(
        415,
        f"Content-Type must be application/json, got {declared!r}"
        if declared
        else "Content-Type must be application/json, got none",
        code="unsupported_media_type",
    )


def _bearer_token(request: Request) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` as sent, or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # NOTE: starlette decodes headers as latin-1; encoding back gives the bytes sent.
    return token.strip().encode("latin-1")


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
