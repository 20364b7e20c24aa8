"""The SSE driver without an engine: frame order, silent steps, held logprobs, errors, closing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Generator
from typing import Any

import pytest
from starlette.types import Message

from inlinelm.api.formats import ChatFormat, CompletionFormat
from inlinelm.api.responses import ResponseHeader, TokenTexts
from inlinelm.api.sse import (
    DONE,
    EventStreamResponse,
    StreamPlan,
    StreamTally,
    TextFrame,
    encode,
    event_stream,
    frame,
    merge_streams,
)
from inlinelm.errors import SlowConsumerError
from inlinelm.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeMetrics:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def observe_http_ttft(self, seconds: float) -> None:
        self.ttft.append(seconds)

    def observe_http_itl(self, seconds: float) -> None:
        self.itl.append(seconds)


class FakeStream:
    """Yields scripted outputs (an exception in the script is raised), counts aclose calls."""

    def __init__(
        self, script: list[RequestOutput | Exception], *, wait: asyncio.Event | None = None
    ) -> None:
        self.script = script
        self.wait = wait
        self.num_closed = 0

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        for item in self.script:
            if self.wait is not None:
                await self.wait.wait()
            await asyncio.sleep(0)
            if isinstance(item, Exception):
                raise item
            yield item

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.num_closed += 1


def out(*choices: CompletionOutput, prompt: int = 3) -> RequestOutput:
    finished = all(c.finish_reason is not None for c in choices)
    return RequestOutput("r", list(choices), finished, list(range(prompt)), RequestMetrics(0.0))


def choice(
    index: int, text: str, tokens: list[int], finish: str | None = None, logprobs: bool = False
) -> CompletionOutput:
    entries = [TokenLogprobs([t, t + 1], [-0.5, -1.5], 1) for t in tokens] if logprobs else None
    return CompletionOutput(index, text, tokens, finish, None, entries)


def plan(
    fmt: Any, *, n: int = 1, usage: bool = False
) -> tuple[StreamPlan, FakeMetrics, list[StreamTally]]:
    metrics, done = FakeMetrics(), list[StreamTally]()
    header = ResponseHeader("id-1", "m", created=7, include_usage=usage)
    return StreamPlan(header, fmt, n, metrics, StreamTally(0.0), done.append), metrics, done


def collect(streams: list[FakeStream], stream_plan: StreamPlan) -> list[Any]:
    async def run() -> list[Any]:
        writes = [w async for w in event_stream(streams, stream_plan)]
        assert all(w.startswith(b"data: ") and w.endswith(b"\n\n") for w in writes)
        # One write per engine step: several choices' frames may share it.
        frames = [f for w in writes for f in w[:-2].split(b"\n\n")]
        assert all(f.startswith(b"data: ") for f in frames)
        payloads = [f[6:].decode() for f in frames]
        return [p if p == DONE else json.loads(p) for p in payloads]

    return asyncio.run(run())


def chat_format(logprobs: bool = False) -> ChatFormat:
    return ChatFormat(TokenTexts(FakeTokenizer()), logprobs)


def test_chat_stream_shape_silent_steps_and_usage() -> None:
    stream = FakeStream(
        [out(choice(0, "He", [1])), out(choice(0, "", [2])), out(choice(0, "llo", [3], "stop"))]
    )
    stream_plan, metrics, done = plan(chat_format(), usage=True)
    frames = collect([stream], stream_plan)
    choices = [f["choices"] for f in frames[:-1]]
    assert choices == [
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        [{"index": 0, "delta": {"content": "He"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "llo"}, "logprobs": None, "finish_reason": "stop"}],
        [],
    ]
    assert all(f["usage"] is None for f in frames[:-2])
    assert frames[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert frames[-1] == DONE
    assert {f["object"] for f in frames[:-1]} == {"chat.completion.chunk"}
    assert stream.num_closed == 1 and len(done) == 1 and done[0].finish_reasons == {0: "stop"}
    assert len(metrics.ttft) == 1 and len(metrics.itl) == 1


def test_logprobs_of_held_back_tokens_travel_with_their_text() -> None:
    stream = FakeStream(
        [
            out(choice(0, "", [1], logprobs=True)),
            out(choice(0, "ab", [2], logprobs=True)),
            out(choice(0, "", [3], "stop", logprobs=True)),
        ]
    )
    stream_plan, _, _ = plan(chat_format(logprobs=True))
    frames = collect([stream], stream_plan)
    content = frames[1]["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["<1>", "<2>"]
    assert content[0]["top_logprobs"] == [{"token": "<2>", "logprob": -1.5, "bytes": list(b"<2>")}]
    finish = frames[2]["choices"][0]
    assert finish["delta"] == {} and [c["token"] for c in finish["logprobs"]["content"]] == ["<3>"]


def test_an_error_after_the_start_becomes_an_error_frame_then_done() -> None:
    stream = FakeStream([out(choice(0, "a", [1])), SlowConsumerError("too slow")])
    stream_plan, _, done = plan(chat_format())
    frames = collect([stream], stream_plan)
    assert frames[-2] == {
        "error": {
            "message": "too slow",
            "type": "server_error",
            "param": None,
            "code": "slow_consumer",
        }
    }
    assert frames[-1] == DONE
    assert stream.num_closed == 1 and done[0].error == "slow_consumer"


def test_completions_index_choices_per_prompt_and_echo() -> None:
    texts = TokenTexts(FakeTokenizer())
    fmt = CompletionFormat(texts, True, True, {0: "P0", 1: "P0", 2: "P1", 3: "P1"})
    first = FakeStream(
        [out(choice(1, "x", [5], "length", logprobs=True)), out(choice(0, "y", [6], "stop"))]
    )
    second = FakeStream([out(choice(0, "z", [7], "stop"), choice(1, "w", [8], "stop"))])
    stream_plan, _, _ = plan(fmt, n=2)
    frames = collect([first, second], stream_plan)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for chunk in frames[:-1]:
        (c,) = chunk["choices"]
        by_index.setdefault(c["index"], []).append(c)
    # NOTE: with echo and logprobs the prompt goes out with the choice's first output,
    # where its logprobs lead (tests/api/test_pooling_api.py has them end to end)
    assert [c["text"] for c in by_index[0]] == ["P0y"]
    assert [c["text"] for c in by_index[3]] == ["P1w"]
    assert by_index[1][0]["logprobs"] == {
        "tokens": ["<5>"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"<6>": -1.5, "<5>": -0.5}],
        "text_offset": [0],
    }
    assert [c["finish_reason"] for c in by_index[1]] == ["length"]
    assert first.num_closed == second.num_closed == 1


def test_merge_streams_cancels_pending_reads_when_closed() -> None:
    async def run() -> None:
        blocked = FakeStream([out(choice(0, "x", [1]))], wait=asyncio.Event())
        ready = FakeStream([out(choice(0, "y", [2]))])
        merged = merge_streams([blocked, ready])
        assert (await anext(merged))[0] == 1
        await merged.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("how", ["send fails", "client leaves during a send"])
def test_event_stream_response_closes_its_generator_when_the_response_ends(how: str) -> None:
    """Whatever ends the response, the generator's ``finally`` (the abort) has run on return."""
    finalized: list[str] = []

    async def events() -> AsyncIterator[str]:
        try:
            while True:
                yield "x"
        finally:
            finalized.append("closed")

    async def run() -> None:
        sent: list[Message] = []
        leave = asyncio.Event()

        async def send(message: Message) -> None:
            sent.append(message)
            if len(sent) == 3:
                if how == "send fails":
                    raise OSError("broken pipe")
                leave.set()
                await asyncio.Event().wait()

        async def receive() -> Message:
            await leave.wait()
            return {"type": "http.disconnect"}

        response = EventStreamResponse(events(), ping_s=0)
        with contextlib.suppress(OSError):
            await response({"type": "http", "method": "POST", "headers": []}, receive, send)
        assert finalized == ["closed"]

    asyncio.run(run())


@pytest.mark.parametrize(
    "text", ["Hello", 'quote " and \\ backslash', "emoji 🐦 早上好\n\ttab", "\x00\x1f ctl"]
)
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_text_frame_fast_path_equals_the_generic_chunk(
    text: str, usage: bool, reason: str | None
) -> None:
    header = ResponseHeader("chatcmpl-abc", "default", 1700000000, include_usage=usage)
    fast = TextFrame.for_chat(header, "chat.completion.chunk").render(3, text, reason)
    generic = frame(
        encode(header.chunk("chat.completion.chunk", [chat_format().delta(3, text, None, reason)]))
    )
    assert fast == generic


def test_one_step_of_several_choices_is_one_write() -> None:
    stream = FakeStream(
        [
            out(choice(0, "a", [1]), choice(1, "b", [2])),
            out(choice(0, "c", [3], "stop"), choice(1, "d", [4], "stop")),
        ]
    )
    stream_plan, _, _ = plan(chat_format(), n=2)

    async def run() -> list[bytes]:
        return [w async for w in event_stream([stream], stream_plan)]

    writes = asyncio.run(run())
    content = [w for w in writes if b'"content":"a"' in w or b'"content":"c"' in w]
    assert [w.count(b"data: ") for w in content] == [2, 2]
    assert content[0].index(b'"content":"a"') < content[0].index(b'"content":"b"')
    assert stream_plan.tally.completion_tokens == 4
