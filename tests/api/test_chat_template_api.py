"""Chat-template control, in Python and over HTTP: a template of one's own (text or file),
template variables per request (``chat_template_kwargs``) over the engine's defaults,
``reasoning_effort`` handed to the template, a template that fails as a 400 naming its
error; and a reasoning chat's usage counting its reasoning tokens.

The echo engine answers with the rendered system turn, so the answer shows exactly what
the template made of the variables.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inlinelm import Engine, RequestError
from inlinelm.api import create_app
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from tests.api.conftest import ECHO, ServerThread, openai_client, serve

# The system turn says what the template was given; <|im_end|> (EOS) ends the echo there.
TEMPLATE = (
    "{{ '<|im_start|>system\\n' }}"
    "thinking={{ enable_thinking }} effort={{ reasoning_effort }} "
    "{{ messages[0]['content'] }}"
    "{% if messages[0]['content'] == 'fail' %}{{ raise_exception('no failing chats') }}{% endif %}"
    "{{ '<|im_end|>\\n<|im_start|>assistant\\n' }}"
)
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def _engine(**options: Any) -> Engine:
    return Engine(replace(ECHO, chat_template=TEMPLATE, **options))


def test_the_engine_renders_its_own_template_with_defaults_and_per_chat_variables() -> None:
    engine = _engine(default_chat_template_kwargs={"enable_thinking": True})
    try:
        [out] = engine.generate_chat(MESSAGES, use_tqdm=False)
        assert out.text == "system\nthinking=True effort= hi"
        [out] = engine.generate_chat(
            MESSAGES,
            use_tqdm=False,
            chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"},
        )
        assert out.text == "system\nthinking=False effort=low hi"
        assert engine.render_chat(MESSAGES, chat_template_kwargs={"reasoning_effort": "x"}) == (
            "<|im_start|>system\nthinking=True effort=x hi<|im_end|>\n<|im_start|>assistant\n"
        )
        with pytest.raises(RequestError, match="apply_chat_template takes it itself") as info:
            engine.generate_chat(MESSAGES, use_tqdm=False, chat_template_kwargs={"tools": []})
        assert info.value.param == "chat_template_kwargs"
        with pytest.raises(RequestError, match="no failing chats") as failed:
            engine.generate_chat([{"role": "user", "content": "fail"}], use_tqdm=False)
        assert failed.value.param == "messages"
    finally:
        engine.close()


def test_a_template_file_is_read_and_bad_chat_options_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    engine = Engine(replace(ECHO, chat_template=str(path)))
    try:
        [out] = engine.generate_chat(MESSAGES, use_tqdm=False)
        assert out.text == "system\nthinking= effort= hi"
    finally:
        engine.close()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"chat_template": str(tmp_path / "missing.jinja")}, "chat_template"),
        ({"chat_template": str(tmp_path)}, "chat_template"),
        ({"default_chat_template_kwargs": {"messages": []}}, "default_chat_template_kwargs"),
        ({"default_chat_template_kwargs": [1]}, "default_chat_template_kwargs"),
        ({"reasoning_parser": "r2"}, "reasoning_parser"),
    ]
    plain = tmp_path / "plain.txt"
    plain.write_text("no template here")
    bad.append(({"chat_template": str(plain)}, "chat_template"))
    for options, option in bad:
        with pytest.raises(ConfigError) as info:
            EngineConfig(**options)
        assert info.value.option == option, options


# -- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    yield from serve(create_app(_engine(default_chat_template_kwargs={"enable_thinking": True})))


def _chat(server: ServerThread, **body: Any) -> httpx.Response:
    payload = {"messages": MESSAGES, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=30)


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(
    server: ServerThread,
) -> None:
    assert _chat(server).json()["choices"][0]["message"]["content"] == (
        "system\nthinking=True effort= hi"
    )
    kwargs = {"enable_thinking": False}
    reply = _chat(server, chat_template_kwargs=kwargs, reasoning_effort="high")
    assert reply.json()["choices"][0]["message"]["content"] == (
        "system\nthinking=False effort=high hi"
    )
    # NOTE: a chat_template_kwargs entry wins over reasoning_effort
    both = _chat(server, chat_template_kwargs={"reasoning_effort": "mine"}, reasoning_effort="low")
    assert both.json()["choices"][0]["message"]["content"].endswith("effort=mine hi")
    with openai_client(server.url) as client:
        sdk = client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            reasoning_effort="low",
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    assert sdk.choices[0].message.content == "system\nthinking=False effort=low hi"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "takes it itself"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of"),
        ({"messages": [{"role": "user", "content": "fail"}]}, "messages", "no failing chats"),
        (
            {"messages": [{"role": "user", "content": "fail"}], "stream": True},
            "messages",
            "no fail",
        ),
    ],
)
def test_bad_template_input_is_a_400_before_any_stream(
    server: ServerThread, body: dict[str, Any], param: str, words: str
) -> None:
    reply = _chat(server, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]


# -- a reasoning chat's usage, and a call inside the thinking ------------------------------


# A template that renders tools itself (it names them), so the echo answers with the system
# turn alone, no tools prompt added to it.
TOOLS_TEMPLATE = (
    "{{ '<|im_start|>system\\n' }}{{ messages[0]['content'] }}{% if tools %}{% endif %}"
    "{{ '<|im_end|>\\n<|im_start|>assistant\\n' }}"
)


@pytest.fixture(scope="module")
def r1_client() -> Iterator[openai.OpenAI]:
    engine = Engine(replace(ECHO, chat_template=TOOLS_TEMPLATE))
    app = create_app(engine, reasoning_parser="deepseek_r1", tool_parser="hermes")
    for running in serve(app):
        with openai_client(running.url) as client:
            yield client


THINKING: list[Any] = [
    {"role": "system", "content": "I should add.</think>\n\n2 + 2 = 4"},
    {"role": "user", "content": "2 + 2?"},
]


def _reasoning_tokens() -> int:
    """The oracle: the echo's tokens (the rendered prompt's, from its first) up to the one
    that completes the closing tag, decoded token by token."""
    engine = Engine(replace(ECHO, chat_template=TOOLS_TEMPLATE))
    try:
        engine.start_sync()
        ids = engine.tokenizer.encode(engine.render_chat(THINKING))
        return next(
            k
            for k in range(len(ids) + 1)
            if "</think>" in engine.tokenizer.decode(ids[:k], skip_special_tokens=True)
        )
    finally:
        engine.close()


def test_usage_counts_the_reasoning_tokens_whole_and_streamed(r1_client: openai.OpenAI) -> None:
    expected = _reasoning_tokens()
    assert expected > 5
    whole = r1_client.chat.completions.create(model="default", messages=THINKING, n=2)
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 2 * expected
    stream = r1_client.chat.completions.create(
        model="default", messages=THINKING, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens_details is not None
    assert usage[0].completion_tokens_details.reasoning_tokens == expected
    assert usage[0].completion_tokens > expected


def test_a_chat_without_a_reasoning_parser_reports_no_reasoning_tokens(
    client: openai.OpenAI,
) -> None:
    reply = client.chat.completions.create(model="default", messages=THINKING)
    assert reply.usage is not None and reply.usage.completion_tokens_details is None


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_inside_the_thinking_is_no_call(r1_client: openai.OpenAI, stream: bool) -> None:
    inside = [{"role": "system", "content": f"maybe {CALL}</think>No call."}, MESSAGES[0]]
    after = [{"role": "system", "content": f"plan</think>{CALL}"}, MESSAGES[0]]
    results = []
    for messages in (inside, after):
        if not stream:
            choice = r1_client.chat.completions.create(
                model="default", messages=messages, tools=[TOOL]
            ).choices[0]
            calls = choice.message.tool_calls or []
            results.append((choice.finish_reason, [c.function.name for c in calls]))
            continue
        names: list[str] = []
        reason = None
        for chunk in r1_client.chat.completions.create(
            model="default", messages=messages, tools=[TOOL], stream=True
        ):
            for c in chunk.choices:
                names += [t.function.name for t in c.delta.tool_calls or [] if t.function.name]
                reason = c.finish_reason or reason
        results.append((reason, names))
    assert results == [("stop", []), ("tool_calls", ["f"])]
