"""Work that grows with one request runs off the event loop, judged by the request's whole
input (DESIGN invariant 12; issue 19, item 4): a chat whose tools are large, a completion
of many prompts each under the inline limit, token-id prompts, /detokenize and echo."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from inlinelm.api import create_app
from inlinelm.config import EngineConfig
from inlinelm.runtime import submission as submission_module
from inlinelm.runtime.workers import decode_all
from tests.api.conftest import ServerThread, serve
from tests.runtime.helpers import echo_engine, run

LIMIT = 1000
JSON = {"content-type": "application/json"}


class Threads:
    """Records the thread each call of a wrapped tokenizer method ran on."""

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}

    def wrap(self, owner: Any, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.names.setdefault(name, []).append(threading.current_thread().name)
            return real(*args, **kwargs)

        setattr(owner, name, recorded)

    def off_loop(self, name: str) -> bool:
        calls = self.names.get(name, [])
        return bool(calls) and all(n.startswith("inlinelm-tokenize") for n in calls)

    def clear(self) -> None:
        self.names.clear()


def tool(i: int, description: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}}
    return {
        "type": "function",
        "function": {"name": f"f{i}", "description": description, "parameters": parameters},
    }


def test_a_chat_with_large_tools_renders_off_the_loop() -> None:
    async def main() -> None:
        async with echo_engine(max_inline_prompt_chars=LIMIT, max_model_len=8192) as engine:
            threads = Threads()
            threads.wrap(engine.tokenizer, "apply_chat_template")
            messages = [{"role": "user", "content": "hi"}]
            tools = [tool(i, "word " * 100) for i in range(4)]  # ~2,000 characters
            stream = engine.chat(messages, tools=tools, max_tokens=2)
            assert stream._submission is None  # not rendered on the loop
            await stream
            assert threads.off_loop("apply_chat_template")
            threads.clear()
            await engine.chat(messages, tools=[tool(0, "short")], max_tokens=2)
            assert threads.names["apply_chat_template"] == [threading.current_thread().name]

    run(main())


def test_a_long_token_id_prompt_is_checked_off_the_loop() -> None:
    async def main() -> None:
        async with echo_engine(max_inline_prompt_chars=LIMIT, max_model_len=8192) as engine:
            ids = engine.tokenizer.encode("word " * 1200)
            assert len(ids) > LIMIT
            stream = engine.stream(ids, max_tokens=2)
            assert stream._submission is None
            assert len((await stream).outputs[0].token_ids) == 2
            short = engine.stream(ids[:10], max_tokens=2)
            assert short._submission is not None  # inline: tokenized and queued at once
            await short

    run(main())


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = EngineConfig(runner="echo", max_inline_prompt_chars=LIMIT, max_model_len=8192)
    yield from serve(create_app(config))


@pytest.fixture
def threads(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> Iterator[Threads]:
    engine = server.server.config.app.state.engine
    threads = Threads()
    tokenizer = engine.tokenizer
    saved = {name: getattr(tokenizer, name) for name in ("encode", "decode")}
    for name in saved:
        threads.wrap(tokenizer, name)
    threads.wrap(submission_module, "decode_all")
    yield threads
    for name, method in saved.items():
        setattr(tokenizer, name, method)
    monkeypatch.setattr(submission_module, "decode_all", decode_all)


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    reply = httpx.post(f"{server.url}{path}", json=body, headers=JSON, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def test_many_prompts_each_under_the_limit_tokenize_off_the_loop(
    server: ServerThread, threads: Threads
) -> None:
    prompts = ["word " * 150 for _ in range(8)]  # 750 characters each, 6,000 in all
    body = {"prompt": prompts, "max_tokens": 2}
    assert len(post(server, "/v1/completions", body).json()["choices"]) == 8
    assert len(threads.names["encode"]) == 8 and threads.off_loop("encode")
    threads.clear()
    post(server, "/v1/completions", {"prompt": "a short one", "max_tokens": 2})
    assert not threads.off_loop("encode")


def test_detokenize_of_many_ids_decodes_off_the_loop(
    server: ServerThread, threads: Threads
) -> None:
    engine = server.server.config.app.state.engine
    ids = list(range(1000, 1000 + LIMIT))
    text = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert threads.off_loop("decode_all")
    threads.clear()
    short = post(server, "/detokenize", {"tokens": ids[:10]}).json()["prompt"]
    assert "decode_all" not in threads.names and not threads.off_loop("decode")
    assert (text, short) == (engine.tokenizer.decode(ids), engine.tokenizer.decode(ids[:10]))


def test_echo_of_many_token_id_prompts_decodes_off_the_loop(
    server: ServerThread, threads: Threads
) -> None:
    prompts = [list(range(2000 + i, 2000 + i + 100)) for i in range(20)]  # 2,000 ids
    body = {"prompt": prompts, "max_tokens": 1, "echo": True}
    choices = post(server, "/v1/completions", body).json()["choices"]
    assert threads.off_loop("decode_all")
    engine = server.server.config.app.state.engine
    for choice, prompt in zip(choices, prompts, strict=True):
        assert choice["text"].startswith(engine.tokenizer.decode(prompt))


def test_decode_all_is_what_the_tokenizer_decodes(tokenizer: Any) -> None:
    """The batch decode off the loop (Rust, GIL released) gives transformers' decode
    exactly: special tokens kept, byte-level pieces; a tokenizer that cleans up spaces
    decodes through transformers itself."""
    import random

    rng = random.Random(0)
    lists = [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 60))] for _ in range(50)]
    lists.append([tokenizer.eos_token_id, 1, 2, 3])
    assert decode_all(tokenizer, lists) == [tokenizer.decode(ids) for ids in lists]
    assert not tokenizer.clean_up_tokenization_spaces  # the Rust path ran
    cleaned = tokenizer.__class__.from_pretrained(
        tokenizer.name_or_path, clean_up_tokenization_spaces=True
    )
    cleaned.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    text_ids = [cleaned.encode("Hello , world ! It 's fine .")]
    assert decode_all(cleaned, text_ids) == [cleaned.decode(text_ids[0])]
    assert decode_all(cleaned, text_ids) != [tokenizer.decode(text_ids[0])]
