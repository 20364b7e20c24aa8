"""The serving stack: ``inlinelm serve`` on uvloop and httptools, the same bytes on every
stack, and orjson frames equal to the stdlib encoder's."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from inlinelm.api import create_app
from inlinelm.api.app import uvicorn_options
from inlinelm.api.responses import ResponseHeader, TokenTexts, chat_logprobs, completion_logprobs
from inlinelm.api.sse import TextFrame, encode, frame
from inlinelm.cli import main
from inlinelm.config import EngineConfig
from inlinelm.runtime.outputs import TokenLogprobs
from tests.api.conftest import ECHO, serve
from tests.runtime.helpers import assert_drained, echo_engine, echo_text

STDLIB = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
TRICKY = 'héllo "quoted" \\ back\tslash\n🐦 早上好 \x00\x1f\x7f \u2028\u2029 \ufeff ok'


# -- inlinelm serve ------------------------------------------------------------------------


def test_inlinelm_serve_runs_uvicorn_on_uvloop_and_httptools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configs: list[uvicorn.Config] = []

    def run(self: uvicorn.Server, sockets: Any = None) -> None:
        configs.append(self.config)
        self.started = True  # uvicorn.run exits 3 after a server that never started

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["serve", "--runner", "echo", "--port", "0"]) == 0
    (config,) = configs
    assert (config.loop, config.http) == ("uvloop", "httptools")
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    factory = config.get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_serve_falls_back_to_asyncio_and_h11_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert uvicorn_options() == {"loop": "uvloop", "http": "httptools"}
    monkeypatch.setitem(sys.modules, "uvloop", None)  # ``import uvloop`` raises ImportError
    monkeypatch.setitem(sys.modules, "httptools", None)
    with caplog.at_level(logging.WARNING, logger="inlinelm.api"):
        assert uvicorn_options() == {"loop": "asyncio", "http": "h11"}
    assert [r.getMessage().split(" ")[0] for r in caplog.records] == ["uvloop", "httptools"]


# -- the same bytes on every stack ---------------------------------------------------------


@contextmanager
def served(config: EngineConfig, loop: str, http: str) -> Iterator[tuple[str, Any]]:
    """``create_app(config)`` under uvicorn with ``loop`` and ``http`` on 127.0.0.1."""
    app = create_app(config)
    for server in serve(app, loop=loop, http=http):
        yield server.url, app.state.engine


STREAMS: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/chat/completions",
        {
            # the echo runner answers the prompt up to its first <|im_end|>: the system text
            "messages": [{"role": "system", "content": TRICKY}, {"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 80,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "stream": True,
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    (
        "/v1/completions",
        {"prompt": TRICKY, "stream": True, "max_tokens": 30, "logprobs": 2},
    ),
]


def raw_streams(base_url: str, engine: Any) -> list[str] | None:
    """Every stream in ``STREAMS``, ids and timestamps fixed; None when a reader lagged
    (merged outputs make fewer, larger frames: a different but equally valid stream)."""
    before = engine.stats()["num_merged_outputs"]
    raws = []
    with httpx.Client(timeout=30) as client:
        for path, body in STREAMS:
            with client.stream("POST", base_url + path, json=body) as response:
                assert response.status_code == 200
                raw = response.read().decode()
            raw = re.sub(r'"id":"(chatcmpl|cmpl)-[0-9a-f]+"', r'"id":"\1-ID"', raw)
            raws.append(re.sub(r'"created":\d+', '"created":0', raw))
    return raws if engine.stats()["num_merged_outputs"] == before else None


def test_a_stream_is_the_same_bytes_on_uvloop_and_httptools_as_on_asyncio_and_h11() -> None:
    config = ECHO.with_options(echo_step_s=0.004)
    results: dict[str, list[str]] = {}
    for loop, http in (("asyncio", "h11"), ("uvloop", "httptools")):
        with served(config, loop, http) as (url, engine):
            for _ in range(3):  # a loaded machine may make the test client lag
                raws = raw_streams(url, engine)
                if raws is not None:
                    results[loop] = raws
                    break
            else:
                pytest.skip("the test client lagged behind the engine in every try")
    assert results["uvloop"] == results["asyncio"]
    chat = results["uvloop"][0]
    assert "🐦" in chat and "\\u0000" in chat  # UTF-8 as is, control characters escaped
    events = [json.loads(e[6:]) for e in chat.split("\n\n") if e.startswith("data: {")]
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert TRICKY in text
    assert '"logprob":' in results["uvloop"][1] and '"token_logprobs":' in results["uvloop"][2]


def test_engine_streams_aborts_and_close_on_uvloop() -> None:
    """The engine thread wakes the loop with ``call_soon_threadsafe``: the same on uvloop."""

    async def main() -> list[str]:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with echo_engine(echo_step_s=0.001) as engine:
            prompts = [f"stream {i}: {TRICKY}" for i in range(8)]

            async def read(prompt: str) -> str:
                return "".join([out.text async for out in engine.stream(prompt, max_tokens=200)])

            endless = engine.stream("endless", ignore_eos=True, max_tokens=8000)
            async for _ in endless:
                break  # leaving the loop aborts the request
            reader = asyncio.create_task(read("cancelled " * 50))
            await asyncio.sleep(0.01)
            reader.cancel()
            texts = await asyncio.gather(*(read(p) for p in prompts))
            stopped = await engine.stream(prompts[0], max_tokens=200, stop=["早上"])
            assert stopped.outputs[0].finish_reason == "stop"
            assert texts == [echo_text(engine, p) for p in prompts]
            await assert_drained(engine)
            return texts

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        texts = runner.run(asyncio.wait_for(main(), 90))
    assert len(texts) == 8 and all("🐦" in t for t in texts)


# -- orjson frames against the stdlib encoder ----------------------------------------------


def stdlib_frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + STDLIB.encode(payload).encode() + b"\n\n"


class TrickyTokenizer:
    """Token ``i`` is ``TRICKY`` from its ``i``-th character on."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return TRICKY[ids[0] % len(TRICKY) :]


texts_strategy = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
floats_strategy = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)  # logprobs


@given(text=texts_strategy, reason=st.sampled_from([None, "stop", "length"]))
def test_text_frames_are_the_stdlib_encoders_bytes(text: str, reason: str | None) -> None:
    header = ResponseHeader("chatcmpl-abc", "default", 1700000000)
    delta = {"index": 1, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
    expected = stdlib_frame(header.chunk("chat.completion.chunk", [delta]))
    assert frame(encode(header.chunk("chat.completion.chunk", [delta]))) == expected
    assert TextFrame.for_chat(header, "chat.completion.chunk").render(1, text, reason) == expected


@given(text=texts_strategy, values=st.lists(floats_strategy, min_size=1, max_size=6))
def test_frames_with_floats_parse_equal_and_are_equal_bytes_but_for_tiny_floats(
    text: str, values: list[float]
) -> None:
    texts = TokenTexts(TrickyTokenizer())
    entries = [TokenLogprobs([i, i + 1, i + 2], [v, v / 3, v / 7], 1) for i, v in enumerate(values)]
    for logprobs in (
        chat_logprobs(entries, texts),
        completion_logprobs(entries, texts, 3),
    ):
        payload = {"choices": [{"text": text, "logprobs": logprobs}], "usage": None}
        ours, theirs = encode(payload), STDLIB.encode(payload).encode()
        assert orjson.loads(ours) == json.loads(theirs) == payload
        if all(_same_repr(v) for e in entries for v in e.logprobs):
            assert ours == theirs


def _same_repr(value: float) -> bool:
    """stdlib JSON writes floats under 1e-4 with an exponent (``1e-05``), orjson without."""
    return value == 0 or abs(value) >= 1e-4


@pytest.mark.parametrize(
    ("value", "stdlib", "ours"),
    [
        (-1.2e-05, b"-1.2e-05", b"-0.000012"),
        (-0.0001, b"-0.0001", b"-0.0001"),
        (-9999.0, b"-9999.0", b"-9999.0"),
        (-1e16, b"-1e+16", b"-1e+16"),
    ],
)
def test_tiny_floats_differ_only_in_notation(value: float, stdlib: bytes, ours: bytes) -> None:
    assert (
        STDLIB.encode(value).encode() == stdlib and encode({"v": value}) == b'{"v":' + ours + b"}"
    )
    assert json.loads(ours) == json.loads(stdlib) == value


def test_nan_and_infinity_become_null_not_invalid_json() -> None:
    encoded = encode({"a": math.nan, "b": -math.inf})
    assert json.loads(encoded) == {"a": None, "b": None}
