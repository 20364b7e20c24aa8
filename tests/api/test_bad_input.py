"""Hostile bodies over a real socket: each is a 4xx with an OpenAI error body, never a 500,
and nothing reaches the engine."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from starlette.types import Message

from inlinelm.api import openai_router
from inlinelm.runtime.engine import Engine
from tests.api.conftest import ECHO
from tests.api.test_errors import check_error

JSON = {"content-type": "application/json"}


def post_raw(base_url: str, path: str, body: str) -> httpx.Response:
    """POST ``body`` as written (JSON escapes such as ``\\ud800`` stay escapes)."""
    return httpx.post(f"{base_url}{path}", content=body.encode(), headers=JSON, timeout=30)


def test_the_fan_out_of_prompts_times_n_is_a_400_before_anything_is_submitted(
    base_url: str, submitted: list[str]
) -> None:
    for stream in (False, True):
        body = {"prompt": ["hi"] * 3000, "n": 4, "stream": stream}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
        assert "256" in check_error(response, 400, param="prompt")["message"]
    assert submitted == []


def test_a_request_at_the_fan_out_cap_is_served(base_url: str, submitted: list[str]) -> None:
    body = {"prompt": ["hi"] * 64, "n": 4, "max_tokens": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 256
    assert submitted == ["stream"] * 64


NINES = "9" * 5000  # past Python's int-from-string digit limit
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "x", "logit_bias": {"\\u00b2": 1}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "x", "logit_bias": {"-3": 1}}', "logit_bias"),
        ("/v1/completions", f'{{"prompt": "x", "logit_bias": {{"{NINES}": 1}}}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "a\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 1' + "0" * 30 + "}", "max_tokens"),
        ("/v1/completions", '{"prompt": "x", "seed": 1' + "0" * 30 + "}", "seed"),
        ("/v1/completions", '{"prompt": "x", "n": 1' + "0" * 30 + "}", "n"),
        ("/v1/completions", '{"prompt": "x", "temperature": 1' + "0" * 400 + "}", "temperature"),
        ("/v1/completions", f'{{"prompt": "x", "max_tokens": {NINES}}}', None),
        ("/v1/completions", f'{{"prompt": [{NINES}]}}', None),
        ("/v1/completions", f'{{"prompt": {DEEP}}}', None),
        ("/v1/chat/completions", DEEP, None),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        (
            "/tokenize",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
    ],
    ids=[
        "logit-bias-unicode-digit",
        "logit-bias-negative",
        "logit-bias-5000-digits",
        "prompt-surrogate",
        "prompts-surrogate",
        "stop-surrogate",
        "chat-content-surrogate",
        "max-tokens-huge",
        "seed-huge",
        "n-huge",
        "temperature-past-float",
        "int-5000-digits",
        "token-id-5000-digits",
        "nested-100000-in-object",
        "nested-100000",
        "tokenize-surrogate",
        "tokenize-messages-surrogate",
    ],
)
def test_hostile_bodies_are_400s_and_submit_nothing(
    base_url: str, submitted: list[str], path: str, body: str, param: str | None
) -> None:
    check_error(post_raw(base_url, path, body), 400, param=param)
    assert submitted == []


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
