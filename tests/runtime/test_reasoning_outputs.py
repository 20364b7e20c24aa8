"""A reasoning model's chat in Python: ``CompletionOutput.reasoning`` beside the answer's
``text``, streamed and whole, split exactly at the tags.

The echo runner answers a chat with its system message (``"system\\n"`` and the text, one
token per engine step, then EOS), so each output below is cut at every token boundary of
a text it controls exactly. The oracle is independent of the engine's split: the whole
text (asked for with ``reasoning_parser="none"``) through :meth:`ReasoningParser.split`, and
for the token count the shortest prefix of the output's ids whose decoded text holds the
closing tag.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from inlinelm import Engine, RequestError
from inlinelm.reasoning import PARSERS
from inlinelm.runtime.outputs import RequestOutput
from tests.runtime.helpers import assert_drained, echo_engine, run

R1 = PARSERS["deepseek_r1"]
QWEN3 = PARSERS["qwen3"]

# The closing tag after text that tokenizes differently before it, and with answers that
# start with blank lines, end in a partial tag, or hold none.
SYSTEMS = [
    "I should add.</think>\n\n2 + 2 = 4",
    "Hmm</think>Yes",
    "a b c d</think>  \n  spaced answer",
    "x</think>",
    "thinking about </thin and </think>the answer ends in </thi",
    "no closing tag at all, all reasoning",
    "ÿ ü 中文 </think>\n中文 answer 🙂",
]


def _messages(system: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "?"}]


def _reasoning_prefix_tokens(engine: Engine, ids: list[int]) -> int:
    """The oracle: how many output tokens it takes for the decoded text to hold the tag."""
    for k in range(len(ids) + 1):
        if "</think>" in engine.tokenizer.decode(ids[:k], skip_special_tokens=True):
            return k
    return len(ids)


async def _deltas(engine: Engine, system: str, **options: Any) -> list[RequestOutput]:
    stream = engine.chat(
        _messages(system), output_kind="delta", max_tokens=None, temperature=0.0, **options
    )
    return [out async for out in stream]


def test_the_closing_tag_spans_several_tokens() -> None:
    """Else a one-token-per-step stream would never cut the tag."""

    async def main() -> None:
        async with echo_engine() as engine:
            assert len(engine.tokenizer.encode("</think>", add_special_tokens=False)) > 1

    run(main())


@pytest.mark.parametrize("system", SYSTEMS)
def test_streamed_deltas_split_at_the_tag_at_every_token_boundary(system: str) -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            whole = await engine.chat(
                _messages(system), reasoning_parser="none", max_tokens=None, temperature=0.0
            )
            assert whole.outputs[0].reasoning is None
            assert whole.text == "system\n" + system
            expected = R1.split(whole.text)
            outs = await _deltas(engine, system, reasoning_parser="deepseek_r1")
            reasoning = "".join(o.outputs[0].reasoning or "" for o in outs)
            answer = "".join(o.text for o in outs)
            assert (reasoning or None, answer or None) == (expected.reasoning, expected.content)
            for out in outs:
                for part in (out.text, out.outputs[0].reasoning or ""):
                    assert "<think>" not in part and "</think>" not in part
            assert [o.outputs[0].reasoning_tokens for o in outs[:-1]] == [None] * (len(outs) - 1)
            ids = [t for o in outs for t in o.token_ids]
            assert ids == whole.token_ids
            count = outs[-1].outputs[0].reasoning_tokens
            assert count == _reasoning_prefix_tokens(engine, ids)
            await assert_drained(engine)

    run(main())


@pytest.mark.parametrize("output_kind", ["cumulative", "final_only"])
def test_cumulative_and_final_outputs_hold_each_part_so_far(output_kind: str) -> None:
    system = SYSTEMS[0]

    async def main() -> None:
        async with echo_engine() as engine:
            stream = engine.chat(
                _messages(system),
                reasoning_parser="deepseek_r1",
                output_kind=output_kind,
                max_tokens=None,
            )
            outs = [out async for out in stream]
            last = outs[-1].outputs[0]
            assert (last.reasoning, last.text) == ("system\nI should add.", "2 + 2 = 4")
            for before, after in itertools.pairwise(outs):
                assert (after.outputs[0].reasoning or "").startswith(
                    before.outputs[0].reasoning or ""
                )
                assert after.text.startswith(before.text)
            assert last.reasoning_tokens == _reasoning_prefix_tokens(engine, last.token_ids)

    run(main())


def test_each_of_n_choices_is_split_on_its_own() -> None:
    async def main() -> None:
        async with echo_engine(max_n=4) as engine:
            out = await engine.chat(
                _messages(SYSTEMS[0]), reasoning_parser="deepseek_r1", n=3, max_tokens=None
            )
            assert [(c.index, c.reasoning, c.text) for c in out.outputs] == [
                (i, "system\nI should add.", "2 + 2 = 4") for i in range(3)
            ]
            counts = {c.reasoning_tokens for c in out.outputs}
            assert counts == {_reasoning_prefix_tokens(engine, out.outputs[0].token_ids)}
            outs = await _deltas(engine, SYSTEMS[0], reasoning_parser="deepseek_r1", n=2)
            for index in (0, 1):
                mine = [c for o in outs for c in o.outputs if c.index == index]
                assert "".join(c.reasoning or "" for c in mine) == "system\nI should add."
                assert "".join(c.text for c in mine) == "2 + 2 = 4"
            await assert_drained(engine)

    run(main())


def test_stop_strings_cut_the_part_they_fall_in() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            in_answer = await engine.chat(
                _messages(SYSTEMS[0]), reasoning_parser="deepseek_r1", stop=["= 4"]
            )
            assert (in_answer.outputs[0].reasoning, in_answer.text) == (
                "system\nI should add.",
                "2 + 2 ",
            )
            assert in_answer.outputs[0].stop_reason == "= 4"
            in_reasoning = await engine.chat(
                _messages(SYSTEMS[0]), reasoning_parser="deepseek_r1", stop=["add"]
            )
            choice = in_reasoning.outputs[0]
            assert (choice.reasoning, choice.text) == ("system\nI should ", "")
            assert choice.reasoning_tokens == len(choice.token_ids)
            # NOTE: a stop string that straddles the tag: the reasoning ends before it
            straddle = await _deltas(
                engine, SYSTEMS[0], reasoning_parser="deepseek_r1", stop=[".</th"]
            )
            assert "".join(o.outputs[0].reasoning or "" for o in straddle) == "system\nI should add"
            assert "".join(o.text for o in straddle) == ""

    run(main())


def test_an_answer_without_thinking_has_no_reasoning() -> None:
    """qwen3: thinking only where the output opens ``<think>``."""

    async def main() -> None:
        async with echo_engine() as engine:
            plain = await engine.chat(_messages("Just the answer."), reasoning_parser="qwen3")
            assert (plain.outputs[0].reasoning, plain.outputs[0].reasoning_tokens) == (None, 0)
            assert plain.text == "system\nJust the answer."
            # NOTE: without a parser (the default model's template knows no <think>) the
            # output is whole and nothing is counted
            assert engine.reasoning_parser is None
            whole = await engine.chat(_messages(SYSTEMS[0]))
            assert (whole.outputs[0].reasoning, whole.outputs[0].reasoning_tokens) == (None, None)
            assert whole.text == "system\n" + SYSTEMS[0]
            completion = await engine.stream("a</think>b", max_tokens=None)
            assert completion.outputs[0].reasoning is None

    run(main())


def test_the_engine_option_sets_every_chats_parser_and_a_chat_may_override_it() -> None:
    async def main() -> None:
        async with echo_engine(reasoning_parser="deepseek_r1") as engine:
            assert engine.reasoning_parser is R1
            out = await engine.chat(_messages(SYSTEMS[1]))
            assert (out.outputs[0].reasoning, out.text) == ("system\nHmm", "Yes")
            whole = await engine.chat(_messages(SYSTEMS[1]), reasoning_parser="none")
            assert whole.text == "system\nHmm</think>Yes"
            with pytest.raises(RequestError, match="unknown reasoning parser 'r2'") as info:
                engine.chat(_messages(SYSTEMS[1]), reasoning_parser="r2")
            assert info.value.param == "reasoning_parser"

    run(main())
    sync = Engine(runner="echo", reasoning_parser="deepseek_r1")
    try:
        [result] = sync.generate_chat(_messages(SYSTEMS[1]), use_tqdm=False)
        assert (result.outputs[0].reasoning, result.text) == ("system\nHmm", "Yes")
    finally:
        sync.close()
