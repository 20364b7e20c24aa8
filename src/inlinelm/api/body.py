"""The HTTP body of a request: read whole within a byte cap, then parsed as JSON.

Every endpoint and a forwarding ingress (:mod:`inlinelm.serve.forward`) read bodies
here, so a body past the cap is the same 413, and one that is not JSON the same 400,
wherever it arrives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from inlinelm.api.errors import APIError, bad_request

MAX_JSON_DEPTH = 128
"""How deep a request body's arrays and objects may nest. Python code that walks them
(JSON encoding, chat templates, schema copies) recurses, and near the interpreter's
recursion limit (about 1,000) it fails with a RecursionError (a 500). llguidance refuses
JSON schemas nested past 128 levels anyway."""


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body parsed as JSON; 413 past ``max_bytes``, 400 when it is not JSON.

    The body is read by :func:`read_body`. JSON that Python cannot hold is not JSON here
    either: nesting past the recursion limit, and integers past the int-from-string digit
    limit, are 400s too.
    """
    return parse_json(await read_body(request, max_bytes))


def parse_json(body: bytes) -> Any:
    """``body`` parsed as JSON (see :func:`read_json` for what is a 400)."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # NOTE: JSONDecodeError, UnicodeDecodeError, int digit limit
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if nesting_depth(value) > MAX_JSON_DEPTH:
        raise _too_deep()
    return value


def nesting_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar is 0), level by level
    without recursion; counting stops one level past ``limit``."""
    depth = 0
    level = [value] if isinstance(value, (dict, list)) else []
    while level and depth <= limit:
        depth += 1
        children: list[Any] = []
        for item in level:
            children.extend(item.values() if isinstance(item, dict) else item)
        level = [child for child in children if isinstance(child, (dict, list))]
    return depth


def _too_deep() -> APIError:
    return bad_request(
        f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json"
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole request body; a 413 past ``max_bytes``.

    The declared ``Content-Length`` is checked first, then the bytes as they arrive, so
    an oversized body is refused without being buffered whole. A client that leaves while
    its body is read raises starlette's ``ClientDisconnect``.
    """
    _check_declared_length(request.headers.get("content-length"), max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def _check_declared_length(declared: str | None, max_bytes: int) -> None:
    """A ``Content-Length`` that is not ASCII digits is a 400; one past ``max_bytes`` a 413."""
    if declared is None:
        return
    if not (declared.isascii() and declared.isdigit()):
        raise bad_request("Content-Length must be a non-negative integer", code="invalid_header")
    if len(declared) > len(str(max_bytes)) or int(declared) > max_bytes:
        raise _too_large(max_bytes)


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than {max_bytes} bytes",
        param=None,
        code="request_too_large",
    )


@dataclass(frozen=True, slots=True)
class JsonBody:
    """A request body, read once by :meth:`ModelTable.dispatch`: ``data`` its parsed JSON,
    ``size`` its bytes, ``arrival`` the ``time.perf_counter()`` before it was read."""

    data: Any
    size: int
    arrival: float
