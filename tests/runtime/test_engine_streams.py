"""Engine.stream end to end on the echo runner: exact texts for 1,000 concurrent streams, the
three output kinds, n > 1, stream_interval, stop strings, UTF-8 and lazy start."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from inlinelm import Engine, OutputKind, RequestOutput, RequestStream, SamplingParams
from inlinelm.sched.request import Request
from tests.helpers import core_of
from tests.runtime.helpers import (
    EOS,
    assert_drained,
    cycled_ids,
    echo_engine,
    echo_text,
    engine_ids,
    num_live_states,
    prompt_ids,
    run,
    runner_of,
)

WORDS = (
    "hello",
    "naïve café",
    "日本語のテキスト",
    "emoji 🦙🚀 party",
    "Ünïcödé",
    "1234 5678",
    "tabs\tand\nnewlines",
    "Привет мир",
    "مرحبا",
    "x",
)


def distinct_prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"stream {i}: {' '.join(rng.choice(WORDS) for _ in range(rng.randrange(1, 6)))}"
        for i in range(count)
    ]


async def read_deltas(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


def test_1000_concurrent_streams_each_get_exactly_their_text() -> None:
    prompts = distinct_prompts(1000)

    async def main() -> None:
        async with echo_engine(max_num_batched_tokens=8192) as engine:
            expected = [echo_text(engine, p) for p in prompts]
            streams = [engine.stream(p, max_tokens=None) for p in prompts]
            # Even streams are read delta by delta, odd ones awaited whole.
            results = await asyncio.gather(
                *(read_deltas(s) if i % 2 == 0 else s for i, s in enumerate(streams))
            )
            for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
                ids = [*prompt_ids(engine, prompt), EOS]
                if isinstance(result, list):
                    assert result, "no output at all"
                    assert [o.finished for o in result] == [False] * (len(result) - 1) + [True]
                    assert all(o.request_id == streams[i].request_id for o in result)
                    assert all("\ufffd" not in o.text for o in result), "a split character leaked"
                    assert "".join(o.text for o in result) == expected[i], prompt
                    assert [t for o in result for t in o.token_ids] == ids
                    assert result[-1].finish_reason == "stop"
                else:
                    assert result.finished
                    assert result.text == expected[i], prompt
                    assert result.token_ids == ids
                    assert result.finish_reason == "stop"
                    assert result.stop_reason is None
                assert streams[i].finished
            assert expected[3] == prompts[3]  # the tokenizer round-trips these prompts
            assert engine.stats()["finished"] == {"stop": 1000}
            await assert_drained(engine)

    run(main())


def test_cumulative_outputs_grow_and_end_with_the_whole_text() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002) as engine:
            prompt = "The cumulative view repeats everything said so far"
            outs = await read_deltas(
                engine.stream(prompt, output_kind="cumulative", max_tokens=None)
            )
            texts = [o.text for o in outs]
            assert len(outs) > 1
            for before, after in itertools.pairwise(texts):
                assert after.startswith(before)
            assert texts[-1] == echo_text(engine, prompt)
            assert outs[-1].token_ids == [*prompt_ids(engine, prompt), EOS]
            assert outs[-1].finished
            whole = await engine.stream(prompt, output_kind=OutputKind.CUMULATIVE, max_tokens=None)
            assert whole.text == echo_text(engine, prompt)

    run(main())


def test_final_only_gives_exactly_one_output() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002) as engine:
            prompt = "Only the end is reported, once"
            outs = await read_deltas(
                engine.stream(prompt, output_kind="final_only", max_tokens=None)
            )
            assert len(outs) == 1
            assert outs[0].finished
            assert outs[0].text == echo_text(engine, prompt)
            assert outs[0].token_ids == [*prompt_ids(engine, prompt), EOS]
            assert outs[0].metrics.num_merged_outputs == 0

    run(main())


def test_final_only_with_n_choices_gives_one_output_holding_every_choice() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002) as engine:
            runner = runner_of(engine)
            echo_next = runner.next_token

            def shorter_first_choice(request: Request, index: int) -> int:
                # Choice 0 ends after two tokens, the others echo the whole prompt.
                if request.request_id.endswith("#0") and index == 2:
                    return EOS
                token: int = echo_next(request, index)
                return token

            runner.next_token = shorter_first_choice
            prompt = "Three choices, reported once at the very end"
            outs = await read_deltas(
                engine.stream(prompt, n=3, output_kind="final_only", max_tokens=None)
            )
            assert len(outs) == 1
            assert outs[0].finished
            assert sorted(o.index for o in outs[0].outputs) == [0, 1, 2]

    run(main())


def test_n_choices_each_get_the_whole_echo_with_their_index() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            added: list[Request] = []
            core = core_of(engine)
            real_add = core.add_request

            def spy(request: Request) -> None:
                added.append(request)
                real_add(request)

            core.add_request = spy  # type: ignore[method-assign]
            prompt = "Every choice echoes this prompt in full"
            expected = echo_text(engine, prompt)
            texts: dict[int, str] = {}
            ids: dict[int, list[int]] = {}
            async for out in engine.stream(prompt, n=3, seed=7, max_tokens=None):
                for choice in out.outputs:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
                    ids.setdefault(choice.index, []).extend(choice.token_ids)
            assert texts == {0: expected, 1: expected, 2: expected}
            assert all(v == [*prompt_ids(engine, prompt), EOS] for v in ids.values())
            stream = engine.stream(prompt, n=3, seed=7, max_tokens=None)
            whole = await stream
            assert [c.index for c in whole.outputs] == [0, 1, 2]
            assert all(c.text == expected and c.finish_reason == "stop" for c in whole.outputs)
            # Each choice is its own engine request with its own seed.
            first = sorted((r.request_id.split("#")[1], r.params.seed) for r in added[:3])
            assert first == [("0", 7), ("1", 8), ("2", 9)]
            assert all(r.params.n == 1 for r in added)
            await assert_drained(engine)

    run(main())


def test_n_choices_share_the_prompts_kv_blocks_through_the_prefix_cache() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            prompt = " ".join(f"shared{i}" for i in range(40))  # several 16-token blocks
            whole = await engine.stream(prompt, n=4, max_tokens=8)
            assert [c.index for c in whole.outputs] == [0, 1, 2, 3]
            expected = prompt_ids(engine, prompt)[:8]
            assert all(c.token_ids == expected for c in whole.outputs)
            assert engine.stats()["prefix_cache_hit_rate"] > 0
            await assert_drained(engine)

    run(main())


def test_stream_interval_sends_the_first_token_at_once_and_flushes_at_the_end() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002, stream_interval=4) as engine:
            prompt = " ".join(f"w{i}" for i in range(20))
            ids = prompt_ids(engine, prompt)
            num_steps = len(ids) + 1  # the echo, then EOS

            # The engine default (4) applies; every output is a put or a merge.
            outs = await read_deltas(engine.stream(prompt, max_tokens=None))
            puts = len(outs) + outs[-1].metrics.num_merged_outputs
            steps_with_output = 1 + len([t for t in range(2, num_steps) if (t - 1) % 4 == 0]) + 1
            assert puts == steps_with_output
            assert len(outs[0].token_ids) == 1 or outs[0].metrics.num_merged_outputs > 0
            assert "".join(o.text for o in outs) == echo_text(engine, prompt)
            assert outs[-1].finished

            # A request's own interval wins over the engine's.
            outs = await read_deltas(engine.stream(prompt, stream_interval=1, max_tokens=None))
            assert len(outs) + outs[-1].metrics.num_merged_outputs == num_steps
            outs = await read_deltas(engine.stream(prompt, stream_interval=100, max_tokens=None))
            puts = len(outs) + outs[-1].metrics.num_merged_outputs
            assert puts == 2  # the first token, then the flush at the end
            assert "".join(o.text for o in outs) == echo_text(engine, prompt)

    run(main())


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_request_and_aborts_it_on_the_engine(include: bool) -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            core = core_of(engine)
            aborted: list[str] = []
            real_abort = core.abort

            def spy(ids: Any) -> None:
                aborted.extend(ids)
                real_abort(ids)

            core.abort = spy  # type: ignore[method-assign]
            prompt = "The quick brown fox jumps over the lazy dog and runs far away"
            full = echo_text(engine, prompt)
            cut = full.index("lazy") + (len("lazy") if include else 0)
            # ignore_eos + a large max_tokens: only the abort can end it on the engine.
            params = SamplingParams(
                stop=["lazy"], include_stop_str_in_output=include, ignore_eos=True, max_tokens=5000
            )
            stream = engine.stream(prompt, params)
            outs = await read_deltas(stream)
            assert "".join(o.text for o in outs) == full[:cut]
            assert outs[-1].finish_reason == "stop"
            assert outs[-1].stop_reason == "lazy"
            assert engine_ids(stream)[0] in aborted
            await assert_drained(engine)
            assert engine.stats()["num_steps"] < 200

    run(main())


def test_text_held_back_for_a_stop_string_is_flushed_when_the_request_ends() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            prompt = "it ends with the start of a stop string: lazy do"
            outs = await read_deltas(engine.stream(prompt, stop=["lazy dog"], max_tokens=None))
            assert "".join(o.text for o in outs) == echo_text(engine, prompt)
            assert outs[-1].finish_reason == "stop"
            assert outs[-1].stop_reason is None
            # Before the end, the possible start of the stop string was held back.
            assert not "".join(o.text for o in outs[:-1]).endswith("lazy do")

    run(main())


def test_max_tokens_ends_with_length() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            prompt = "one two three four five six seven eight"
            out = await engine.stream(prompt, max_tokens=3)
            assert out.finish_reason == "length"
            assert out.token_ids == prompt_ids(engine, prompt)[:3]
            cycled = await engine.stream(prompt, ignore_eos=True, max_tokens=40)
            assert cycled.token_ids == cycled_ids(prompt_ids(engine, prompt), 40)
            assert cycled.finish_reason == "length"

    run(main())


def test_token_id_prompts_and_logprobs_come_through() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            ids = prompt_ids(engine, "token ids in, the same ids out")
            outs = await read_deltas(engine.stream(ids, logprobs=2, max_tokens=None))
            assert [t for o in outs for t in o.token_ids] == [*ids, EOS]
            logprobs = [lp for o in outs for lp in (o.logprobs or [])]
            assert [lp.token_ids[0] for lp in logprobs] == [*ids, EOS]
            whole = await engine.stream(ids, logprobs=0, max_tokens=None)
            assert whole.logprobs is not None
            assert len(whole.logprobs) == len(ids) + 1

    run(main())


def test_a_stream_on_a_never_started_engine_starts_it() -> None:
    async def main() -> None:
        engine = echo_engine()
        assert not engine.is_ready
        stream = engine.stream("lazy start works")
        assert not engine.is_ready  # stream() itself does no loading
        out = await stream
        assert engine.is_ready
        assert out.text == echo_text(engine, "lazy start works")
        await engine.aclose()

    run(main())


def test_chat_echoes_the_rendered_template() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hi"},
            ]
            rendered = engine.render_chat(messages)
            assert "Say hi" in rendered
            ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
            # The echo stops at the first <|im_end|> (EOS) of the rendered template.
            ids = ids[: ids.index(EOS) + 1]
            out = await engine.chat(messages, max_tokens=None)
            assert out.token_ids == ids
            assert out.text == engine.tokenizer.decode(ids, skip_special_tokens=True)
            assert "Be brief." in out.text

    run(main())


def test_chat_on_a_never_started_engine_does_not_load_on_the_loop() -> None:
    async def main() -> None:
        engine = echo_engine()
        try:
            stream = engine.chat([{"role": "user", "content": "hi"}])
            assert not engine.is_ready, "chat() loaded the model on the event loop"
            await stream
        finally:
            await engine.aclose()

    run(main())


def test_request_outputs_carry_consistent_timings() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002) as engine:
            prompt = "timings on every output of this request"
            outs = await read_deltas(engine.stream(prompt, max_tokens=None))
            m = outs[-1].metrics
            assert m.scheduled_time is not None
            assert m.first_token_time is not None
            assert m.last_token_time is not None
            assert m.finished_time is not None
            assert m.arrival_time <= m.scheduled_time <= m.first_token_time
            assert m.first_token_time <= m.last_token_time <= m.finished_time
            assert m.ttft is not None and m.ttft > 0
            assert m.e2e is not None and m.e2e >= m.ttft
            assert 0 < len(m.inter_token_latencies) <= len(prompt_ids(engine, prompt))
            assert m.tpot is not None and m.tpot > 0
            assert num_live_states(engine) == (0, 0)

    run(main())


def test_engine_accepts_an_engine_config_and_options() -> None:
    from inlinelm import EngineConfig

    engine = Engine(EngineConfig(runner="echo"), max_num_seqs=8)
    assert engine.config.runner == "echo"
    assert engine.config.max_num_seqs == 8
    assert not engine.is_ready
    engine.close()
