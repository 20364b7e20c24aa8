"""The official ``openai`` client against a real server: it must parse everything we send.

The echo engine answers with the prompt echoed, so every expected text is known exactly.
"""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]
# What the echo engine answers to USER: the chat template's text up to its first
# <|im_end|> (the EOS token ends the echo), special tokens skipped.
ANSWER = "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="default", messages=USER, max_tokens=8)
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and reply.model == "default"
    assert choice.message.role == "assistant" and ANSWER.startswith(choice.message.content or "")
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_runs_to_eos_without_max_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="default", messages=USER)
    assert reply.choices[0].message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"


def test_chat_stream_with_usage_and_n(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default",
        messages=USER,
        n=2,
        max_completion_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    usages = []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts[0] == texts[1] and ANSWER.startswith(texts[0]) and texts[0]
    assert finish == {0: "length", 1: "length"}
    assert len(usages) == 1 and usages[0].completion_tokens == 20


def test_stop_strings(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="default", messages=USER, stop=["Hugging"])
    assert (
        reply.choices[0].message.content
        == "system\nYou are a helpful AI assistant named SmolLM, trained by "
    )
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="default", messages=USER, stop="Hugging", stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content


def test_chat_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default",
        messages=USER,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 3
    first = logprobs.content[0]
    assert (
        first.token == "<|im_start|>"
        and first.logprob == 0.0
        and first.bytes == list(b"<|im_start|>")
    )
    assert len(first.top_logprobs) == 2


def test_completions(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="default", prompt="Once upon a time", max_tokens=3)
    assert reply.object == "text_completion" and reply.choices[0].text == "Once upon a"
    assert reply.choices[0].finish_reason == "length"
    echoed = client.completions.create(model="default", prompt="Hi there", max_tokens=9, echo=True)
    assert (
        echoed.choices[0].text == "Hi thereHi there" and echoed.choices[0].finish_reason == "stop"
    )


def test_completions_stream_n_and_several_prompts(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="default",
        prompt=["one two", "three"],
        n=2,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "one two", 1: "one two", 2: "three", 3: "three"}
    assert usage is not None and usage.prompt_tokens == 3


def test_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="default", prompt="Hello world", max_tokens=2, logprobs=1
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["Hello", " world"] and logprobs.text_offset == [0, 5]
    assert logprobs.token_logprobs == [0.0, 0.0]
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] == {"Hello": 0.0}


def test_errors_raise_the_clients_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=USER, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4", messages=USER)
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default",
            messages=USER,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert info.value.param == "tool_choice.function.name"


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["default"]
