"""The wire format over a real socket (httpx + httpx-sse), pinned by golden files."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from inlinelm.api import create_app
from inlinelm.config import EngineConfig
from tests.api.conftest import ECHO, ServerThread, serve
from tests.test_cli import _wait_until_serving

GOLDEN = Path(__file__).parent / "golden"
USER = [{"role": "user", "content": "Tell me a story"}]


def sse_data(url: str, body: dict[str, Any]) -> list[str]:
    """The ``data`` of every event of a streamed response."""
    with httpx.Client(timeout=30) as client, connect_sse(client, "POST", url, json=body) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [event.data for event in source.iter_sse()]


def chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    data = sse_data(url, body)
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def per_choice(frames: list[dict[str, Any]], key: str) -> dict[int, str]:
    """Concatenated text of each choice (``key``: ``content`` for chat, ``text`` for completions)."""
    texts: dict[int, str] = {}
    for frame in frames:
        for c in frame["choices"]:
            piece = c["delta"].get("content", "") if key == "content" else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


def normalise(raw: str) -> str:
    """Fix ids and timestamps, and join consecutive content chunks of one choice.

    Joining keeps the golden file independent of how many engine steps the collector
    merged while the test client lagged; every other byte of the stream is pinned. A
    choice's first chunk (the role, or the echoed prompt) is never joined.
    """
    raw = re.sub(r'"id":"(chatcmpl|cmpl)-[0-9a-f]+"', r'"id":"\1-ID"', raw)
    raw = re.sub(r'"created":\d+', '"created":0', raw)
    lines: list[str] = []
    seen: set[int] = set()
    joinable = False  # may the next chunk be joined to the last line?
    for line in (e for e in raw.split("\n\n") if e.strip()):
        assert line.startswith("data: "), line
        current = None if line == "data: [DONE]" else json.loads(line[6:])
        index = current["choices"][0]["index"] if current and len(current["choices"]) == 1 else None
        merged = (
            _join(json.loads(lines[-1][6:]), current) if joinable and index is not None else None
        )
        if merged is not None:
            lines[-1] = "data: " + json.dumps(merged, ensure_ascii=False, separators=(",", ":"))
            continue
        joinable = index is not None and index in seen
        if index is not None:
            seen.add(index)
        lines.append(line)
    return "\n\n".join(lines) + "\n\n"


def _join(previous: Any, current: Any) -> Any:
    """``previous`` with ``current``'s text appended, or None when they must stay apart."""
    if previous is None or len(previous["choices"]) != 1:
        return None
    (a,), (b,) = previous["choices"], current["choices"]
    if a["index"] != b["index"] or a["finish_reason"] is not None:
        return None
    if "delta" in a:
        if set(a["delta"]) != {"content"} or set(b["delta"]) != {"content"}:
            return None
        a["delta"]["content"] += b["delta"]["content"]
    else:
        a["text"] += b["text"]
    a["finish_reason"] = b["finish_reason"]
    return previous


def raw_stream(url: str, body: dict[str, Any]) -> str:
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        return response.read().decode()


def check_golden(name: str, raw: str) -> None:
    path = GOLDEN / name
    text = normalise(raw)
    if os.environ.get("INLINELM_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_frames_are_compact_json_data_lines(base_url: str) -> None:
    raw = raw_stream(
        f"{base_url}/v1/chat/completions", {"messages": USER, "stream": True, "max_tokens": 4}
    )
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        data = event.removeprefix("data: ")
        assert data == json.dumps(json.loads(data), ensure_ascii=False, separators=(",", ":"))


def test_golden_chat_stream(base_url: str) -> None:
    body = {
        "messages": USER,
        "stream": True,
        "max_tokens": 12,
        "stream_options": {"include_usage": True},
    }
    check_golden("chat_stream.txt", raw_stream(f"{base_url}/v1/chat/completions", body))


def test_golden_completion_stream(base_url: str) -> None:
    body = {"prompt": "Once upon a time", "stream": True, "max_tokens": 3, "echo": True}
    check_golden("completion_stream.txt", raw_stream(f"{base_url}/v1/completions", body))


def test_streamed_text_equals_the_whole_response_for_each_of_n_choices(base_url: str) -> None:
    body = {"messages": USER, "n": 2, "max_tokens": 9, "stop": ["story"]}
    whole = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30).json()
    frames = chunks(f"{base_url}/v1/chat/completions", {**body, "stream": True})
    streamed = per_choice(frames, "content")
    assert streamed == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    finishes = [
        (c["index"], c["finish_reason"]) for f in frames for c in f["choices"] if c["finish_reason"]
    ]
    assert sorted(finishes) == sorted((c["index"], c["finish_reason"]) for c in whole["choices"])
    roles = [c["index"] for f in frames for c in f["choices"] if "role" in c["delta"]]
    assert sorted(roles) == [0, 1]
    last_of_choice = {c["index"]: c for f in frames for c in f["choices"]}
    for frame in frames:
        for c in frame["choices"]:
            assert c["delta"] != {"content": ""}, "no empty content chunk"
            assert c["finish_reason"] is None or c is last_of_choice[c["index"]], (
                "the finish_reason rides on the choice's last chunk"
            )


def test_several_prompts_stream_with_their_own_indexes(base_url: str) -> None:
    body = {
        "prompt": ["alpha beta", "gamma"],
        "n": 2,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    frames = chunks(f"{base_url}/v1/completions", body)
    assert per_choice(frames[:-1], "text") == {
        0: "alpha beta",
        1: "alpha beta",
        2: "gamma",
        3: "gamma",
    }
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["prompt_tokens"] == 3


def test_logprobs_in_streams_align_with_text(base_url: str) -> None:
    body = {"messages": USER, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "stream": True}
    frames = chunks(f"{base_url}/v1/chat/completions", body)
    for frame in frames[1:]:
        (c,) = frame["choices"]
        if c["delta"].get("content"):
            tokens = "".join(t["token"] for t in c["logprobs"]["content"])
            # Special tokens have logprobs like any other, but skip_special_tokens drops their text.
            assert re.sub(r"<\|im_(start|end)\|>", "", tokens) == c["delta"]["content"]
            assert all(len(t["top_logprobs"]) == 2 for t in c["logprobs"]["content"])


def test_http_ttft_and_itl_feed_the_engine_metrics(echo_app: Any, base_url: str) -> None:
    engine = echo_app.state.engine
    before = engine.stats()["histograms"]["http_ttft_seconds"]["count"]
    chunks(f"{base_url}/v1/completions", {"prompt": "a b c d e f", "max_tokens": 6, "stream": True})
    after = engine.stats()["histograms"]
    assert after["http_ttft_seconds"]["count"] == before + 1
    assert after["http_ttft_seconds"]["sum"] > 0
    text = httpx.get(f"{base_url}/metrics").text
    assert "inlinelm_http_ttft_seconds_count" in text and "inlinelm_http_itl_seconds_count" in text


def test_models_health_tokenize_detokenize(base_url: str) -> None:
    models = httpx.get(f"{base_url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "default"
    assert models["data"][0]["max_model_len"] > 0
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": USER}).json()
    usage = httpx.post(
        f"{base_url}/v1/chat/completions", json={"messages": USER, "max_tokens": 1}
    ).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerThread]:
    """An engine whose steps take 50 ms, pinging idle streams every 20 ms."""
    config = EngineConfig(model="default", runner="echo", echo_step_s=0.05)
    yield from serve(create_app(config, sse_ping_s=0.02))


def test_idle_streams_get_keep_alive_pings(slow_server: ServerThread) -> None:
    body = {"prompt": "a b c", "max_tokens": 4, "stream": True}
    raw = raw_stream(f"{slow_server.url}/v1/completions", body)
    assert any(line.startswith(": ping") for line in raw.splitlines())
    assert raw.rstrip().endswith("data: [DONE]")


def test_an_error_after_the_200_is_an_error_event_then_done() -> None:
    config = ECHO.with_options(echo_step_s=0.02)
    app = create_app(config)
    for server in serve(app):
        # its owner closes the engine mid-stream (any thread may)
        data = _stream_stopped_midway(server.url, app.state.engine.close)
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["code"] == "engine_closed" and error["type"] == "server_error"


def _stream_stopped_midway(url: str, stop: Callable[[], object]) -> list[str]:
    """The data of a long completion stream's events, ``stop()`` called once it started."""
    body = {"prompt": "x y", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        connect_sse(client, "POST", f"{url}/v1/completions", json=body) as source,
    ):
        events = source.iter_sse()
        next(events)  # the stream has started: the 200 is sent
        stop()
        return [e.data for e in events]


SLOW_APP = """
from inlinelm.api import create_app
from inlinelm.config import EngineConfig

app = create_app(EngineConfig(model="default", runner="echo", echo_step_s=0.05))
"""


def test_a_stopping_server_ends_open_streams_with_an_error_event_then_done(
    tmp_path: Path,
) -> None:
    # `uvicorn app:app` in its own process: Ctrl-C reaches uvicorn as it reaches a user's.
    (tmp_path / "slow_app.py").write_text(SLOW_APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "uvicorn", "slow_app:app", "--app-dir", str(tmp_path)]
    process = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(url, process, timeout=120)
        data = _stream_stopped_midway(url, lambda: process.send_signal(signal.SIGINT))
        # 1000 tokens at 50 ms would take 50 s: the stream was ended, not finished.
        assert data[-1] == "[DONE]" and len(data) < 200, data[-3:]
        error = json.loads(data[-2])["error"]
        assert error == {
            "message": "the server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "engine_closed",
        }
        _, stderr = process.communicate(timeout=30)  # then the server stops, at once
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "Application shutdown complete" in stderr
