"""Constraints after thinking: with a reasoning parser on, ``response_format``, ``guided_*``
and forced tool calls constrain only what follows the closing tag; the reasoning is free.

The tokenizer is the default model's with ``<think>`` and ``</think>`` added as tokens (as
Qwen3's and DeepSeek-R1's have them) and a Qwen3-style template (``enable_thinking``). The
echo runner answers with the system text, token by token, except where a grammar refuses
its token (it then takes the lowest one the grammar allows): reasoning text that is no JSON
comes back as written only if no grammar constrained it, and the answer after the tag must
validate. A tiny random Qwen3 on the same tokenizer checks the prompt-closed case on the
real model path: ``enable_thinking=false`` closes the block in the prompt, so the grammar
holds from the first token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from inlinelm import Engine
from inlinelm.api import create_app
from inlinelm.reasoning import PARSERS
from tests.api.conftest import ECHO, openai_client, serve
from tests.conftest import make_tiny_model

QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
# For the echo: the system text first (the answer it echoes), then the template's turns.
ECHO_TEMPLATE = (
    "{{ messages[0]['content'] }}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "{%- if tools %}{%- endif %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{%- endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
REASONING = "Let me plan; no JSON here, {unbalanced"
SYSTEM = f"<think>{REASONING}</think>" + '{"answer": 4}'


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    folder = tmp_path_factory.mktemp("thinking-tokenizer")
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def client(thinking_tokenizer: Path) -> Iterator[openai.OpenAI]:
    engine = Engine(replace(ECHO, tokenizer=str(thinking_tokenizer), chat_template=ECHO_TEMPLATE))
    for server in serve(create_app(engine)):
        with openai_client(server.url) as c:
            yield c


def _messages(system: str = SYSTEM) -> list[Any]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]


def test_the_tags_are_single_tokens_and_the_template_picks_qwen3(
    thinking_tokenizer: Path,
) -> None:
    engine = Engine(replace(ECHO, tokenizer=str(thinking_tokenizer)))
    try:
        engine.start_sync()
        assert engine.reasoning_parser is PARSERS["qwen3"]
        assert len(engine.tokenizer.encode("</think>", add_special_tokens=False)) == 1
    finally:
        engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_the_schema_constrains_only_the_answer_after_the_thinking(
    client: openai.OpenAI, stream: bool
) -> None:
    if stream:
        reasoning = content = ""
        for chunk in client.chat.completions.create(
            model="default", messages=_messages(), response_format=FORMAT, stream=True
        ):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
    else:
        message = (
            client.chat.completions.create(
                model="default", messages=_messages(), response_format=FORMAT
            )
            .choices[0]
            .message
        )
        reasoning = (message.model_extra or {})["reasoning_content"]
        content = message.content or ""
    assert reasoning == REASONING
    jsonschema.validate(json.loads(content), SCHEMA)
    assert json.loads(content) == {"answer": 4}


def test_without_a_parser_the_schema_constrains_from_the_first_token(
    thinking_tokenizer: Path,
) -> None:
    engine = Engine(
        replace(
            ECHO,
            tokenizer=str(thinking_tokenizer),
            chat_template=ECHO_TEMPLATE,
            reasoning_parser="none",
        )
    )
    for server in serve(create_app(engine)):
        with openai_client(server.url) as c:
            reply = c.chat.completions.create(
                model="default", messages=_messages(), response_format=FORMAT, max_tokens=64
            )
    content = reply.choices[0].message.content or ""
    assert "think" not in content and REASONING not in content
    jsonschema.validate(json.loads(content), SCHEMA)


def test_a_prompt_that_closed_the_thinking_constrains_from_the_first_token(
    client: openai.OpenAI,
) -> None:
    reply = client.chat.completions.create(
        model="default",
        messages=_messages(),
        response_format=FORMAT,
        max_tokens=64,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = reply.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)


def test_a_forced_call_is_made_after_the_thinking(client: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }
    system = "<think>I will call f, maybe with {a: one}</think>" + '{"a": 1}'
    reply = client.chat.completions.create(
        model="default",
        messages=_messages(system),
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "f"}},
    )
    message = reply.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "I will call f, maybe with {a: one}"
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"a": 1}


def _ask_tiny(folder: Path, reasoning_parser: str | None, **body: Any) -> Any:
    """One chat answer of the tiny model served by an app of its own (which closes it)."""
    engine = Engine(model=str(folder), num_threads=1, max_model_len=256)
    for server in serve(create_app(engine, reasoning_parser=reasoning_parser)):
        with openai_client(server.url) as c:
            return c.chat.completions.create(
                model=engine.model_name,
                messages=_messages("hi"),
                max_tokens=40,
                temperature=0.0,
                **body,
            ).choices[0]
    raise AssertionError("not served")


def test_a_tiny_qwen3_constrains_after_the_prompts_or_its_own_closing_tag(
    tmp_path_factory: pytest.TempPathFactory, thinking_tokenizer: Path
) -> None:
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"),
        thinking_tokenizer,
        model_type="qwen3",
        vocab_size=49154,
        head_dim=16,
    )
    # NOTE: a schema whose every answer is short: a random model would not end a number
    schema = {**SCHEMA, "properties": {"answer": {"type": "boolean"}}}
    bounded = {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}
    closed = _ask_tiny(
        folder,
        None,
        response_format=bounded,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert closed.finish_reason == "stop", closed
    jsonschema.validate(json.loads(closed.message.content or ""), schema)
    # NOTE: thinking on, with the closing tag made the likeliest token: the grammar waits
    # for it on the model's own path, then holds (it never sees the tag, or it would fail)
    engine = Engine(model=str(folder), num_threads=1, max_model_len=256)
    try:
        engine.start_sync()
        assert engine.reasoning_parser is PARSERS["qwen3"]
        prompt = engine.render_chat(
            _messages("hi"), chat_template_kwargs={"enable_thinking": False}
        )
        assert prompt.rstrip().endswith("<think>\n\n</think>")
        [end_id] = engine.tokenizer.encode("</think>", add_special_tokens=False)
    finally:
        engine.close()
    thought = _ask_tiny(
        folder,
        "deepseek_r1",
        response_format=bounded,
        logit_bias={str(end_id): 100},
        logprobs=True,
    )
    assert thought.finish_reason == "stop", thought
    assert thought.logprobs is not None and thought.logprobs.content is not None
    assert thought.logprobs.content[0].token == "</think>"
    jsonschema.validate(json.loads(thought.message.content or ""), schema)
