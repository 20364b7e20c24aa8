"""Who may call the API: the Host a request names, an optional bearer key, and bodies
declared as JSON.

**Hosts** (DNS rebinding): a web page can point a name it controls at 127.0.0.1 and then
read what a local server answers, as if it were the page's own site. The browser still
sends the page's name in ``Host``, so a router without a key serves only requests that
name a loopback host (``localhost``, ``127.0.0.1``, ``[::1]``, any port) or one of its
``allowed_hosts``; any other is a 403 (``host_not_allowed``), before any other work. With
a key, the page cannot get past the key, so any host is served unless ``allowed_hosts``
is given: then it holds, key or not. ``"*"`` in ``allowed_hosts`` serves every host (for
an app whose own middleware checks hosts); ``"*.example.com"`` serves its subdomains. A
request with no ``Host`` at all (HTTP/1.0, an in-process call) is not a browser's and passes.

**Key**: with an API key, every endpoint but ``/health`` wants ``Authorization: Bearer
<key>`` (what OpenAI clients send); a missing or wrong key is a 401 with
``WWW-Authenticate: Bearer``. The key is compared in constant time.

**Bodies**: every endpoint that reads a body wants ``Content-Type: application/json`` (or
an ``application/*+json`` type), key or no key. A browser sends a cross-site POST without
asking first only when its type is ``text/plain``, a form, or missing; refusing all
three (415) means a web page cannot drive a local server through its visitors' browsers.
curl users add ``-H 'content-type: application/json'``, as OpenAI's own examples do.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import Response

from inlinelm.api.errors import APIError

Endpoint = Callable[[Request], Awaitable[Response]]

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
"""The host names a keyless router serves without being told more (any port)."""


class Access:
    """The checks in front of every endpoint of one router."""

    def __init__(self, api_key: str | None, allowed_hosts: Iterable[str] | None = None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string, or None for no key")
        self._key = None if api_key is None else api_key.encode("utf-8")
        self._hosts = HostCheck.for_router(api_key is not None, allowed_hosts)

    def guard(
        self,
        endpoint: Endpoint,
        *,
        needs_key: bool = True,
        checks_host: bool = True,
        json_body: bool,
    ) -> Endpoint:
        """``endpoint`` behind the host check (when ``checks_host``), the key check (when
        ``needs_key``) and the JSON-body check, in that order."""

        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            try:
                if checks_host:
                    self._hosts.check(request)
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


class HostCheck:
    """Which ``Host`` headers one router serves (see the module docstring).

    ``names`` are exact host names (lower case, IPv6 in brackets, no port); ``suffixes``
    come from ``*.example.com`` entries; ``any_host`` serves every request.
    """

    def __init__(self, names: frozenset[str], suffixes: tuple[str, ...], any_host: bool) -> None:
        self.names = names
        self.suffixes = suffixes
        self.any_host = any_host

    @classmethod
    def for_router(cls, has_key: bool, allowed_hosts: Iterable[str] | None) -> HostCheck:
        """Loopback names plus ``allowed_hosts``; every host when a key guards the router
        and no ``allowed_hosts`` were given."""
        if allowed_hosts is None:
            return cls(LOOPBACK_HOSTS, (), any_host=has_key)
        entries = [host_name(entry) for entry in allowed_hosts]
        if any(not entry for entry in entries):
            raise ValueError("allowed_hosts holds an empty host name")
        suffixes = tuple(entry[1:] for entry in entries if entry.startswith("*."))
        names = {entry for entry in entries if not entry.startswith("*")}
        return cls(LOOPBACK_HOSTS | names, suffixes, any_host="*" in entries)

    def allows(self, host: str) -> bool:
        """Whether a request naming ``host`` (a ``Host`` header's value) is served."""
        if self.any_host:
            return True
        name = host_name(host)
        return name in self.names or (bool(name) and name.endswith(self.suffixes))

    def check(self, request: Request) -> None:
        """A 403 unless the request's ``Host`` is served here.

        A request without a ``Host`` header passes: a browser always sends one (DNS
        rebinding needs it to name the page's site), an in-process call may not.
        """
        host = request.headers.get("host")
        if host is None or self.allows(host):
            return
        shown = host if len(host) <= 100 else host[:100] + "…"
        raise APIError(
            403,
            f"the host {shown!r} is not served here: only loopback hosts (localhost, "
            "127.0.0.1, [::1]) and the allowed hosts are (inlinelm serve --allowed-hosts, or "
            "the router's allowed_hosts=); this guards a server against DNS rebinding",
            code="host_not_allowed",
        )


def host_name(host: str) -> str:
    """The name in a ``Host`` value or an ``allowed_hosts`` entry: lower case, without its
    port; an IPv6 address in brackets (``::1`` and ``[::1]:8000`` both give ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else ""
    if host.count(":") > 1:  # a bare IPv6 address (only an entry can be one)
        return f"[{host}]"
    return host.partition(":")[0]


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
