"""The request body (:mod:`inlinelm.api.body`): JSON or a 400, at most
``max_request_bytes`` or a 413 (declared or counted as it arrives), a ``Content-Length``
that is a number, and a client that leaves while its body is read is no error."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Message

from inlinelm.api import openai_router
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO
from tests.api.test_errors import JSON, check_error


def test_bad_json_is_a_400(base_url: str) -> None:
    for content in (b"{not json", b"\xff\xfe", b""):
        response = httpx.post(
            f"{base_url}/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
        )
        check_error(response, 400, code="invalid_json")


def test_a_body_over_max_request_bytes_is_a_413(base_url: str) -> None:
    big = json.dumps({"prompt": "x" * (5 * 1024 * 1024)}).encode()
    check_error(
        httpx.post(f"{base_url}/v1/completions", content=big, headers=JSON),
        413,
        code="request_too_large",
    )

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced as bytes arrive
        for _ in range(6):
            yield b" " * (1024 * 1024)

    check_error(
        httpx.post(f"{base_url}/v1/completions", content=chunked(), headers=JSON),
        413,
        code="request_too_large",
    )


def test_a_client_gone_while_its_body_is_read_is_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = openai_router(Engine(ECHO))
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"prompt": "a', "more_body": True},
        {"type": "http.disconnect"},
    ]
    with caplog.at_level(logging.DEBUG, logger="inlinelm"):
        sent = asyncio.run(_call(router, "/v1/completions", messages))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(m.get("status", 499) < 500 for m in sent)


def test_a_content_length_that_is_not_a_number_is_a_4xx() -> None:
    router = openai_router(Engine(ECHO))
    for declared in ("9" * 5000, "\u00b2", "-1"):
        sent = asyncio.run(
            _call(
                router,
                "/v1/completions",
                [{"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}],
                headers=((b"content-length", declared.encode("latin-1")),),
            )
        )
        assert 400 <= sent[0]["status"] < 500, declared


async def _call(
    app: Any, path: str, messages: list[Message], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> list[Message]:
    """One ASGI call of ``app``; returns what it sent."""
    incoming = iter(messages)
    sent: list[Message] = []

    async def receive() -> Message:
        return next(incoming, {"type": "http.disconnect"})

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    return sent
