"""The chat page at ``/``, in a real headless Chromium: it streams, stops, and takes a key.

The echo engine answers with the prompt, so the text the page must show is known exactly.
A chat's prompt is its template, whose first turn ends with ``<|im_end|>``, SmolLM2's EOS:
the test server's ``engine.chat`` sets ``ignore_eos``, and the page's own "max tokens"
setting ends the answer where the prompt ends, so the answer is the whole conversation.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from inlinelm.api import create_app, openai_router
from inlinelm.runtime.engine import Engine
from inlinelm.runtime.stream import RequestStream
from inlinelm.sampling_params import SamplingParams
from tests.api.conftest import ECHO, ServerThread, serve
from tests.browser import Browser, Page, find_chromium
from tests.helpers import wait_for

KEY = "sesame"
# Markup in a prompt comes back in the echo: the page must show it as text.
MARKUP = '<img src=x onerror="window.pwned = 1"> is <b>not</b> bold & "quoted"'
LAST_ANSWER = "[...document.querySelectorAll('#log .msg.assistant')].at(-1)"


# -- without a browser -----------------------------------------------------------------------


def test_create_app_serves_the_page_and_the_router_alone_has_none() -> None:
    page = TestClient(create_app(ECHO)).get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>inlinelm chat</title>" in page.text
    bare = Starlette(routes=[Mount("/", app=openai_router(Engine(ECHO)))])
    assert TestClient(bare).get("/").status_code == 404


def test_the_page_loads_nothing_from_elsewhere_and_runs_only_its_own_script() -> None:
    page = TestClient(create_app(ECHO)).get("/")
    assert re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text) is None
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "connect-src 'self'" in policy
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'(;|$)", policy)
    assert "innerHTML" not in page.text
    assert "insertAdjacentHTML" not in page.text


# -- in the browser --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    path = find_chromium()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium on PATH: `make test` installs Debian's package")
        pytest.skip("no chromium on PATH (`make test` installs Debian's package)")
    with Browser.launch(path) as launched:
        yield launched


@pytest.fixture(scope="module")
def app() -> Any:
    # NOTE: a slow echo step, so that an answer is still streaming when Stop is clicked.
    app = create_app(ECHO.with_options(echo_step_s=0.02))
    engine = app.state.engine
    engine.chat = ignoring_eos(engine.chat)
    return app


def ignoring_eos(chat: Callable[..., RequestStream]) -> Callable[..., RequestStream]:
    """``Engine.chat`` with ``ignore_eos`` set: the echo goes past the template's first EOS."""

    def chat_on(
        messages: Sequence[dict[str, Any]], params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestStream:
        return chat(messages, replace(params or SamplingParams(), ignore_eos=True), **kwargs)

    return chat_on


@pytest.fixture(scope="module")
def server(app: Any) -> Iterator[ServerThread]:
    yield from serve(app)


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerThread]:
    yield from serve(create_app(ECHO, api_key=KEY))


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where screenshots go: ``$INLINELM_SCREENSHOT_DIR`` when set (to look at), else tmp."""
    folder = Path(os.environ.get("INLINELM_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_page(browser: Browser, url: str) -> Page:
    page = browser.new_page()
    page.goto(f"{url}/")
    return page


def ask(page: Page, prompt: str) -> None:
    """Type ``prompt`` into the message box and press Enter, as a person does."""
    page.type("#prompt", prompt)
    page.press_enter()


def wait_for_answer(page: Page) -> str:
    """The last answer's text once its stream has ended (Send is enabled again)."""
    page.wait_for(f"!document.getElementById('send').disabled && {LAST_ANSWER} !== undefined")
    text: str = page.evaluate(f"{LAST_ANSWER}.querySelector('.text').textContent")
    return text


def echo_of(url: str, body: dict[str, Any], key: str | None = None) -> str:
    """What the server answers a chat ``body`` with, not streamed."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


def prompt_length(url: str, messages: list[dict[str, str]]) -> int:
    """The number of tokens of ``messages`` in the chat template."""
    response = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60)
    response.raise_for_status()
    count: int = response.json()["count"]
    return count


def set_max_tokens(page: Page, value: int) -> None:
    """Open the settings if closed and type ``value`` as the answer's length limit."""
    if not page.evaluate("document.querySelector('details').open"):
        page.click("details summary")
    page.evaluate("document.getElementById('max-tokens').value = ''")
    page.type("#max-tokens", str(value))


def test_a_prompt_streams_its_answer_into_the_page_as_text(
    browser: Browser, server: ServerThread, screenshots: Path
) -> None:
    page = open_page(browser, server.url)
    page.wait_for("document.getElementById('status').textContent === 'ready'")
    assert page.evaluate("document.getElementById('model').textContent") == "default"

    first = [{"role": "user", "content": MARKUP}]
    set_max_tokens(page, prompt_length(server.url, first))
    ask(page, MARKUP)
    answer = wait_for_answer(page)
    assert MARKUP in answer
    assert answer == echo_of(
        server.url, {"messages": first, "max_tokens": prompt_length(server.url, first)}
    )
    assert page.evaluate("document.querySelectorAll('#log img, #log b').length") == 0
    assert page.evaluate("window.pwned") is None
    meta = page.evaluate(f"{LAST_ANSWER}.querySelector('.meta').textContent")
    assert re.fullmatch(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens · cut at max tokens", meta), meta

    # The page keeps the conversation: the second request carries the first exchange.
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    set_max_tokens(page, prompt_length(server.url, second))
    ask(page, "And?")
    assert wait_for_answer(page) == echo_of(
        server.url, {"messages": second, "max_tokens": prompt_length(server.url, second)}
    )

    shot = page.screenshot()
    assert shot.startswith(b"\x89PNG")
    (screenshots / "chat_page.png").write_bytes(shot)


def test_stop_aborts_the_request_on_the_server(
    browser: Browser, app: Any, server: ServerThread, screenshots: Path
) -> None:
    engine = app.state.engine
    aborted_before = engine.stats()["finished"].get("abort", 0)
    page = open_page(browser, server.url)
    page.wait_for("document.getElementById('status').textContent === 'ready'")

    # No max tokens and EOS ignored: the echo would go on to the end of the context.
    ask(page, "Tell me everything.")
    page.wait_for(f"{LAST_ANSWER}.querySelector('.text').textContent.length > 40")
    assert engine.num_free_kv_blocks < engine.num_kv_blocks  # it runs
    page.click("#stop")

    wait_for(lambda: engine.stats()["finished"].get("abort", 0) == aborted_before + 1)
    wait_for(lambda: engine.num_free_kv_blocks == engine.num_kv_blocks)
    assert engine.stats()["num_running"] == 0
    partial = wait_for_answer(page)
    assert partial
    assert page.evaluate(f"{LAST_ANSWER}.querySelector('.meta').textContent").endswith("stopped")
    # The partial answer stays in the conversation the next request sends.
    assert page.evaluate("state.history.at(-1).content") == partial
    (screenshots / "chat_page_stopped.png").write_bytes(page.screenshot())


def test_a_server_with_a_key_asks_for_it_and_the_page_sends_it(
    browser: Browser, keyed_server: ServerThread
) -> None:
    page = open_page(browser, keyed_server.url)
    page.wait_for("!document.getElementById('key-panel').hidden")
    assert page.evaluate("document.getElementById('status').textContent") == "needs an API key"

    page.type("#api-key", KEY)
    page.click("#save-key")
    page.wait_for("document.getElementById('status').textContent === 'ready'")
    ask(page, "hello")
    answer = wait_for_answer(page)
    assert answer == echo_of(
        keyed_server.url, {"messages": [{"role": "user", "content": "hello"}]}, KEY
    )
    # Not asked to remember it: the key lives in the page's memory only.
    assert page.evaluate("localStorage.getItem('inlinelm.apiKey')") is None
    assert json.loads(page.evaluate("JSON.stringify(state.history)"))[0]["content"] == "hello"
