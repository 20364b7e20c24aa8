"""Hostile bodies over a real socket: each is a 4xx with an OpenAI error body, never a 500,
and nothing reaches the engine."""

from __future__ import annotations

import httpx
import pytest

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
