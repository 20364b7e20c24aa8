"""Stop strings past the engine's caps (``max_stop_strings`` 16, ``max_stop_string_chars``
1024 by default) are a 400 naming ``stop`` before any 200, streamed or not; at the caps the
request is served."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.test_errors import USER, check_error

BODIES = [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), BODIES, ids=["completions", "chat"])
@pytest.mark.parametrize(
    "stop", [[f"stop{i}" for i in range(17)], ["x" * 1025]], ids=["17-stops", "1025-chars"]
)
def test_stop_strings_past_the_caps_are_a_400_naming_stop(
    base_url: str, path: str, body: dict[str, Any], stream: bool, stop: list[str]
) -> None:
    response = httpx.post(
        f"{base_url}{path}", json={**body, "stop": stop, "stream": stream}, timeout=30
    )
    check_error(response, 400, param="stop")


@pytest.mark.parametrize(("path", "body"), BODIES, ids=["completions", "chat"])
def test_stop_strings_at_the_caps_are_served(
    base_url: str, path: str, body: dict[str, Any]
) -> None:
    stop = [f"{i:02d}" + "§" * 1022 for i in range(16)]
    response = httpx.post(
        f"{base_url}{path}", json={**body, "stop": stop, "max_tokens": 4}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
