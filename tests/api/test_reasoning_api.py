"""A reasoning model's chat answers: the thinking in ``reasoning_content``, the answer in
``content``, whole and streamed (split exactly at the tag however the text is cut), left
out with ``include_reasoning: false``, and a tool call inside the thinking is no call.

The echo engine answers a chat with its system message (``"system\\n"`` and the text):
with the ``deepseek_r1`` parser (the prompt opens ``<think>``), everything before the
system text's ``</think>`` is reasoning.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from inlinelm.api import create_app
from inlinelm.api.formats import ChatFormat
from inlinelm.api.reasoning_format import ReasoningChatFormat
from inlinelm.api.responses import TokenTexts
from inlinelm.reasoning import PARSERS, parser_for_template
from inlinelm.runtime.outputs import CompletionOutput
from tests.api.conftest import ECHO, openai_client, serve

R1 = PARSERS["deepseek_r1"]
ANSWER = "Let me think.\nIt is 4.</think>\n\nThe answer is 4."


class _NoTexts(TokenTexts):
    def __init__(self) -> None:
        super().__init__(None)


def _format(include: bool = True) -> ReasoningChatFormat:
    return ReasoningChatFormat(ChatFormat(_NoTexts(), False), include, _NoTexts(), False)


def _streamed(fmt: ReasoningChatFormat, text: str) -> list[dict[str, Any]]:
    """The chunk choices of ``text`` streamed one character per engine output, split as
    the engine splits it."""
    stream = R1.stream()
    choices = []
    for i, char in enumerate(text):
        last = i == len(text) - 1
        reasoning, content = stream.feed(char)
        if last:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if reasoning or content or last:
            reason = "stop" if last else None
            choices.append(fmt.delta(0, content, None, reason, reasoning or None))
    return [c for c in choices if c is not None]


def _parts(choices: list[dict[str, Any]]) -> tuple[str, str]:
    reasoning = "".join(c["delta"].get("reasoning_content", "") for c in choices)
    content = "".join(c["delta"].get("content", "") for c in choices)
    return reasoning, content


def test_a_stream_sends_reasoning_content_first_then_content() -> None:
    sent = _streamed(_format(), ANSWER)
    assert _parts(sent) == ("Let me think.\nIt is 4.", "The answer is 4.")
    assert sent[-1]["finish_reason"] == "stop"
    kinds = [next(iter(c["delta"])) for c in sent if c["delta"]]
    first_content = kinds.index("content")
    assert set(kinds[:first_content]) == {"reasoning_content"}
    assert set(kinds[first_content:]) == {"content"}


def test_the_whole_answer_carries_both_and_include_reasoning_false_drops_the_thinking() -> None:
    split = R1.split(ANSWER)
    output = CompletionOutput(0, split.content or "", [], "stop", reasoning=split.reasoning)
    message = _format().whole(0, output)["message"]
    assert message == {
        "role": "assistant",
        "reasoning_content": "Let me think.\nIt is 4.",
        "content": "The answer is 4.",
    }
    assert _format(include=False).whole(0, output)["message"] == {
        "role": "assistant",
        "content": "The answer is 4.",
    }
    assert _parts(_streamed(_format(include=False), ANSWER)) == ("", "The answer is 4.")


# -- the openai SDK against an echo server with the deepseek_r1 parser ----------------------


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    app = create_app(ECHO, reasoning_parser="deepseek_r1")
    for server in serve(app):
        with openai_client(server.url) as c:
            yield c


MESSAGES: list[Any] = [
    {"role": "system", "content": "I should add.</think>\n\n2 + 2 = 4"},
    {"role": "user", "content": "2 + 2?"},
]


def test_the_sdk_reads_reasoning_content_apart_from_the_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="default", messages=MESSAGES)
    message = reply.choices[0].message
    assert message.content == "2 + 2 = 4"
    assert (message.model_extra or {})["reasoning_content"] == "system\nI should add."


def test_a_stream_sends_reasoning_content_deltas_then_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="default", messages=MESSAGES, stream=True)
    reasoning = content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("system\nI should add.", "2 + 2 = 4")


def test_include_reasoning_false_answers_without_it(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=MESSAGES, extra_body={"include_reasoning": False}
    )
    message = reply.choices[0].message
    assert message.content == "2 + 2 = 4"
    assert "reasoning_content" not in (message.model_extra or {})


def test_an_unknown_parser_is_refused_when_the_app_is_made() -> None:
    with pytest.raises(ValueError, match="no reasoning parser named 'r2'"):
        create_app(ECHO, reasoning_parser="r2")


def test_the_template_family_picks_the_parser() -> None:
    smollm2 = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    assert parser_for_template(smollm2, "<|im_start|>assistant\n") is None
    r1 = "{{ '<｜Assistant｜><think>\\n' }}"
    assert parser_for_template(r1, "<｜User｜>?<｜Assistant｜><think>\n") is PARSERS["deepseek_r1"]
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert parser_for_template(qwen3, "<|im_start|>assistant\n") is PARSERS["qwen3"]


def test_a_template_that_opens_the_thinking_gets_its_parser_without_being_told(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The default model's tokenizer with a template whose generation prompt opens
    ``<think>`` (as DeepSeek-R1's does): no ``reasoning_parser`` given, the answers split;
    ``"none"``, they stay whole."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert isinstance(tok.chat_template, str)
    tok.chat_template = tok.chat_template.replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"
    )
    assert "<think>" in tok.chat_template
    tok.save_pretrained(str(tmp_path))
    app = create_app(replace(ECHO, tokenizer=str(tmp_path)))
    for server in serve(app):
        with openai_client(server.url) as c:
            message = (
                c.chat.completions.create(model="default", messages=MESSAGES).choices[0].message
            )
    assert message.content == "2 + 2 = 4"
    assert (message.model_extra or {})["reasoning_content"] == "system\nI should add."
    whole_app = create_app(replace(ECHO, tokenizer=str(tmp_path)), reasoning_parser="none")
    for server in serve(whole_app):
        with openai_client(server.url) as c:
            whole = c.chat.completions.create(model="default", messages=MESSAGES).choices[0]
    assert whole.message.content == "system\nI should add.</think>\n\n2 + 2 = 4"
