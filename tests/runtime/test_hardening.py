"""No caller can kill, wedge or stall the engine (invariants 7, 8, 11 and 12).

Each test here reproduces a way one request used to take the engine down for everyone or
leave streams hanging: seeds and token ids the engine thread could not take, duplicate and
reused request ids, streams dropped unread or closed from another thread, faults in the
output handler, inputs the caller mutates after submitting, and prompts big enough to stall
the event loop while they are tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest

from inlinelm import (
    Engine,
    EngineDeadError,
    RequestError,
    RequestFailedError,
    RequestStream,
    SamplingParams,
)
from inlinelm.sampling_params import MAX_SEED, MIN_SEED
from inlinelm.sched.request import Request
from tests.helpers import bridges_of, core_of
from tests.runtime.helpers import (
    WAIT_S,
    RunnerGate,
    assert_drained,
    echo_engine,
    echo_text,
    engine_ids,
    num_live_states,
    prompt_ids,
    run,
    wait_event,
    wait_until,
)

ENDLESS = {"ignore_eos": True, "max_tokens": 5000}


async def read_all(stream: RequestStream) -> str:
    return "".join([out.outputs[0].text async for out in stream if out.outputs])


# -- 1. values the engine thread could not take are refused at submit ---------------------


@pytest.mark.parametrize(
    ("seed", "n"),
    [(MAX_SEED + 1, 1), (MIN_SEED - 1, 1), (MAX_SEED, 2), (MAX_SEED - 2, 4), (10**30, 1)],
)
def test_a_seed_torch_cannot_take_is_a_request_error(seed: int, n: int) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(seed=seed, n=n)
    assert info.value.param == "seed"


@pytest.mark.parametrize(("seed", "n"), [(MAX_SEED, 1), (MIN_SEED, 1), (MAX_SEED - 3, 4)])
def test_the_extreme_seeds_torch_takes_are_accepted(seed: int, n: int) -> None:
    import torch

    params = SamplingParams(seed=seed, n=n)
    for i in range(params.n):  # every derived seed of an n > 1 request
        torch.Generator().manual_seed(seed + i)


def test_out_of_vocab_token_ids_are_refused_and_the_engine_lives_on() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            vocab = len(engine.tokenizer)
            bad: list[dict[str, Any]] = [
                {"min_tokens": 1, "stop_token_ids": [vocab]},
                {"stop_token_ids": [10**9]},
                {"logit_bias": {vocab: 1.0}},
            ]
            for overrides in bad:
                with pytest.raises(RequestError) as info:
                    engine.stream("hello", **overrides)
                assert info.value.param in overrides
            with pytest.raises(RequestError):
                engine.stream([1, 2, vocab])
            assert engine.healthy
            assert await read_all(engine.stream("still serving", max_tokens=None)) == echo_text(
                engine, "still serving"
            )
            await assert_drained(engine)

    run(main())


# -- 1. request ids ----------------------------------------------------------------------


def test_a_duplicate_id_in_flight_is_refused_and_the_first_stream_finishes() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            first = engine.stream("the first request", request_id="dup", max_tokens=None)
            with pytest.raises(RequestError) as info:
                engine.stream("the second request", request_id="dup")
            assert info.value.param == "request_id"
            assert engine.healthy
            assert await read_all(first) == echo_text(engine, "the first request")
            # The id is free once its request is over.
            again = await engine.stream("reused", request_id="dup", max_tokens=None)
            assert again.outputs[0].text == echo_text(engine, "reused")
            await assert_drained(engine)

    run(main())


def test_choice_ids_of_n_above_1_do_not_collide_with_caller_ids() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            two = engine.stream("two choices", request_id="x", n=2, max_tokens=None)
            other = engine.stream("a caller id like a choice's", request_id="x#1", max_tokens=None)
            both, single = await asyncio.gather(two, other)
            assert [c.text for c in both.outputs] == [echo_text(engine, "two choices")] * 2
            assert single.outputs[0].text == echo_text(engine, "a caller id like a choice's")
            assert len(set(engine_ids(two)) | set(engine_ids(other))) == 3
            await assert_drained(engine)

    run(main())


def test_one_id_from_two_event_loops_is_refused_on_the_second() -> None:
    engine = echo_engine()
    engine.start_sync()
    try:
        holding = threading.Event()
        release = threading.Event()

        async def hold() -> str:
            stream = engine.stream("held on loop one", request_id="shared", **ENDLESS)
            async for _ in stream:
                holding.set()
                await asyncio.to_thread(release.wait, WAIT_S)
                break
            return "done"

        thread_result: list[str] = []
        thread = threading.Thread(target=lambda: thread_result.append(asyncio.run(hold())))
        thread.start()
        assert holding.wait(WAIT_S)

        async def second() -> None:
            with pytest.raises(RequestError):
                engine.stream("from loop two", request_id="shared")

        asyncio.run(second())
        release.set()
        thread.join(WAIT_S)
        assert thread_result == ["done"]
        assert engine.healthy
    finally:
        engine.close()


def test_an_id_reused_right_after_its_abort_gets_its_own_full_answer() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            for _ in range(20):
                old = engine.stream("the old request", request_id="again", **ENDLESS)
                async for _ in old:
                    await old.aclose()  # NOTE: at once; a bare break aborts one loop turn later
                new = engine.stream("the new one", request_id="again", max_tokens=None)
                out = await new
                assert out.finished
                assert out.outputs[0].finish_reason == "stop"
                assert out.outputs[0].text == echo_text(engine, "the new one")
            await assert_drained(engine)
            assert engine.stats()["finished"]["abort"] == 20

    run(main())


def test_a_request_whose_add_fails_on_the_engine_thread_fails_alone() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            scheduler = core_of(engine).scheduler
            real_add = scheduler.add_request

            def add(request: Request) -> None:
                if request.prompt_token_ids == prompt_ids(engine, "poison"):
                    raise RuntimeError("injected: add_request fell over")
                real_add(request)

            scheduler.add_request = add  # type: ignore[method-assign]
            good = engine.stream("a good request", max_tokens=None)
            with pytest.raises(RequestFailedError):
                await engine.stream("poison")
            assert (await good).outputs[0].text == echo_text(engine, "a good request")
            assert engine.healthy
            await assert_drained(engine)

    run(main())


# -- 2. no stream hangs ------------------------------------------------------------------


def test_a_stream_dropped_unread_aborts_its_request() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            stream = engine.stream("never read", **ENDLESS)
            await wait_until(lambda: engine.num_free_kv_blocks < engine.num_kv_blocks)
            del stream
            gc.collect()
            await assert_drained(engine)
            assert engine.stats()["finished"] == {"abort": 1}

    run(main())


@pytest.mark.parametrize("where", ["another loop", "a plain thread"])
def test_a_stream_closed_from_another_thread_aborts_and_its_reader_sees_the_end(
    where: str,
) -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            stream = engine.stream("closed from elsewhere", **ENDLESS)
            outs = []
            async for out in stream:
                outs.append(out)
                if len(outs) == 1:
                    if where == "another loop":
                        await asyncio.to_thread(asyncio.run, stream.aclose())
                    else:
                        await asyncio.to_thread(stream._close)
            assert outs[-1].finished
            assert outs[-1].outputs[0].finish_reason == "abort"
            await assert_drained(engine)

    run(main())


def test_one_requests_fault_in_the_output_handler_fails_only_that_request() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            victim = engine.stream("this one breaks", **ENDLESS)
            others = [engine.stream(f"bystander {i}", max_tokens=None) for i in range(5)]
            bridge = bridges_of(engine)[0]
            state = bridge.processor.states[engine_ids(victim)[0]]

            def broken(*args: Any, **kwargs: Any) -> None:
                raise ValueError("injected: the detokenizer fell over")

            state.detokenizer.update = broken
            with pytest.raises(RequestFailedError) as info:
                await victim
            assert isinstance(info.value.__cause__, ValueError)
            outs = await asyncio.gather(*others)
            assert [o.outputs[0].text for o in outs] == [
                echo_text(engine, f"bystander {i}") for i in range(5)
            ]
            assert engine.healthy
            await assert_drained(engine)
            assert engine.stats()["finished"]["error"] == 1

    run(main())


def test_a_fault_of_the_output_handler_itself_ends_every_stream_and_marks_the_engine() -> None:
    async def main() -> None:
        engine = echo_engine(echo_step_s=0.001)
        await engine.start()
        streams = [engine.stream(f"stream {i}", **ENDLESS) for i in range(20)]
        bridge = bridges_of(engine)[0]
        real = bridge.processor.process_outputs
        armed = threading.Event()

        def process(outputs: Any, step_start: float) -> list[str]:
            if armed.is_set():
                armed.clear()
                raise RuntimeError("injected: the output handler fell over")
            result: list[str] = real(outputs, step_start)
            return result

        bridge.processor.process_outputs = process  # type: ignore[method-assign]

        async def consume(stream: RequestStream) -> BaseException:
            try:
                async for _ in stream:
                    armed.set()
            except BaseException as e:
                return e
            raise AssertionError("the stream ended normally")

        errors = await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), WAIT_S)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert all(isinstance(e.__cause__, RuntimeError) for e in errors)
        ok, reason = engine.health()
        assert not ok
        assert reason.startswith("dead")
        assert num_live_states(engine) == (0, 0)
        with pytest.raises(EngineDeadError):
            engine.stream("refused")
        # The engine thread was stopped: it freed every block on its way out.
        core = core_of(engine)
        assert await asyncio.to_thread(core.join, WAIT_S)
        assert core.stats.num_free_blocks == core.stats.num_kv_blocks
        await asyncio.wait_for(engine.aclose(), WAIT_S)
        async with echo_engine() as fresh:
            assert (await fresh.stream("a new engine", max_tokens=None)).outputs[
                0
            ].text == echo_text(fresh, "a new engine")

    run(main())


# -- 5. stop tokens ----------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_the_text_of_a_matched_stop_token_is_left_out_unless_asked_for(include: bool) -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            prompt = "one two three four"
            ids = prompt_ids(engine, prompt)
            stop_id = ids[2]
            out = await engine.stream(
                prompt, stop_token_ids=[stop_id], include_stop_str_in_output=include
            )
            choice = out.outputs[0]
            assert choice.finish_reason == "stop"
            assert choice.stop_reason == stop_id
            assert choice.token_ids == ids[:3]
            kept = ids[:3] if include else ids[:2]
            assert choice.text == engine.tokenizer.decode(kept)

    run(main())


# -- 6. inputs are owned -----------------------------------------------------------------


def test_sampling_params_are_immutable_and_own_their_lists() -> None:
    stop, bias = ["x"], {5: 1.0}
    params = SamplingParams(stop=stop, logit_bias=bias)
    stop.append("y")
    bias[6] = 2.0
    assert params.stop == ("x",)
    assert params.logit_bias == {5: 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        params.logit_bias[6] = 2.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        params.stop.append("y")  # type: ignore[attr-defined]
    assert params.logit_bias == {5: 1.0}
    # NOTE: nothing in it can change, so it is shared, never copied.
    assert params.copy() is params
    assert pickle.loads(pickle.dumps(params)) == params


def test_nothing_the_caller_still_holds_reaches_the_engine_thread() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            core = core_of(engine)
            added: list[Request] = []
            real_add = core.add_request
            core.add_request = lambda r: (added.append(r), real_add(r))  # type: ignore[method-assign]
            params = SamplingParams(max_tokens=None, stop=["never"])
            ids = prompt_ids(engine, "owned prompt")
            with RunnerGate(engine) as gate:
                gate.close()
                stream = engine.stream(ids, params)
                await wait_event(gate.entered)
                ids.append(99)
            out = await stream
            assert added[0].prompt_token_ids == ids[:-1]
            assert added[0].params.stop == ("never",)
            assert out.outputs[0].text == echo_text(engine, "owned prompt")

    run(main())


# -- 3. no request stalls the others -----------------------------------------------------


def test_a_large_prompt_is_tokenized_off_the_event_loop_while_others_stream() -> None:
    async def main() -> None:
        async with echo_engine(max_inline_prompt_chars=1000, max_model_len=8192) as engine:
            tokenizer = engine.tokenizer
            real_encode = tokenizer.encode
            entered, release = threading.Event(), threading.Event()
            threads: dict[int, str] = {}

            def encode(text: str, **kwargs: Any) -> list[int]:
                threads[len(text)] = threading.current_thread().name
                if len(text) > 1000:
                    entered.set()
                    assert release.wait(WAIT_S)
                result: list[int] = real_encode(text, **kwargs)
                return result

            tokenizer.encode = encode
            try:
                big_prompt = "word " * 1000
                big = engine.stream(big_prompt, max_tokens=4)
                big_task = asyncio.ensure_future(big)
                await wait_event(entered)
                # The big prompt's tokenizer call is blocked; the loop still serves others.
                small = await engine.stream("a small one", max_tokens=None)
                assert small.outputs[0].text == echo_text(engine, "a small one")
                release.set()
                out = await big_task
                assert len(out.outputs[0].token_ids) == 4
            finally:
                tokenizer.encode = real_encode
            assert threads[len(big_prompt)].startswith("inlinelm-tokenize")
            assert threads[len("a small one")] == threading.current_thread().name

    run(main())


def test_a_large_chat_is_rendered_off_the_loop_and_its_errors_raise_on_submit() -> None:
    async def main() -> None:
        async with echo_engine(max_inline_prompt_chars=1000, max_model_len=512) as engine:
            messages = [{"role": "user", "content": "word " * 1000}]
            stream = engine.chat(messages)
            assert stream._submission is None  # not tokenized on the loop
            with pytest.raises(RequestError) as info:
                await stream.submit()
            assert info.value.param == "messages"
            with pytest.raises(RequestError):
                await engine.chat([{"role": "user", "content": "\ud800" * 2000}])
            assert engine.healthy
            await assert_drained(engine)

    run(main())


def test_closing_the_engine_stops_the_tokenizer_threads() -> None:
    async def main() -> None:
        before = set(threading.enumerate())
        async with echo_engine(max_inline_prompt_chars=10) as engine:
            await engine.stream("a prompt past the inline limit", max_tokens=2)
            assert any(t.name.startswith("inlinelm-tokenize") for t in threading.enumerate())
        left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        assert not [t for t in left if t.name.startswith("inlinelm")], left

    run(main())


def test_extreme_seeds_and_stop_ids_with_the_model_runner(tiny_model_dir: Path) -> None:
    """The values that used to kill the model runner's engine thread: the largest seeds it
    takes run (n > 1 derives seed + i), and an out-of-vocab stop id is refused at submit."""

    async def main() -> None:
        async with Engine(model=str(tiny_model_dir), runner="model") as engine:
            vocab = core_of(engine).runner.model_config.vocab_size
            out = await engine.stream("hi", seed=MAX_SEED - 1, n=2, max_tokens=3)
            assert [len(c.token_ids) for c in out.outputs] == [3, 3]
            out = await engine.stream("hi", seed=MIN_SEED, max_tokens=3)
            assert len(out.outputs[0].token_ids) == 3
            with pytest.raises(RequestError):
                engine.stream("hi", min_tokens=1, stop_token_ids=[vocab])
            assert engine.healthy
            await assert_drained(engine)

    run(main())


def test_engine_tokenize_matches_what_stream_and_chat_send_and_goes_off_loop_when_large() -> None:
    async def main() -> None:
        async with echo_engine(max_inline_prompt_chars=100) as engine:
            messages = [{"role": "user", "content": "hello there"}]
            assert await engine.tokenize("hello there") == prompt_ids(engine, "hello there")
            rendered = engine.render_chat(messages)
            expected = engine.tokenizer.encode(rendered, add_special_tokens=False)
            assert await engine.tokenize(messages=messages) == expected
            big = "word " * 100
            threads: list[str] = []
            real_encode = engine.tokenizer.encode

            def encode(text: str, **kwargs: Any) -> list[int]:
                threads.append(threading.current_thread().name)
                result: list[int] = real_encode(text, **kwargs)
                return result

            engine.tokenizer.encode = encode
            try:
                assert await engine.tokenize(big) == real_encode(big)
            finally:
                engine.tokenizer.encode = real_encode
            assert threads[0].startswith("inlinelm-tokenize")
            with pytest.raises(RequestError):
                await engine.tokenize("\ud800" * 200)

    run(main())
