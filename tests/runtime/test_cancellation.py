"""Leaving a stream early frees everything (DESIGN invariants 1 and 7): a cancelled task,
``aclose()`` and an abandoned ``async for`` each abort the request; after any mix of finished,
aborted and failed requests no request state, collector or KV block is left."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from inlinelm import EngineClosedError, RequestStream, SamplingParams, SlowConsumerError
from inlinelm.sched.output import EngineCoreOutput, EngineCoreOutputs
from inlinelm.sched.request import Request
from tests.helpers import bridges_of, core_of, dispatcher_of
from tests.runtime.helpers import (
    WAIT_S,
    RunnerGate,
    assert_drained,
    cycled_ids,
    echo_engine,
    echo_text,
    engine_ids,
    num_live_states,
    prompt_ids,
    run,
    wait_event,
    wait_until,
)

NUM_STREAMS = 400
SHORT = 40  # tokens the streams that are left alone generate
ENDLESS = 8000  # the cancelled ones would run (ignore_eos) for 8000 steps unless aborted


def test_cancelling_a_random_half_mid_stream_leaves_nothing_behind() -> None:
    rng = random.Random(5)
    cancelled = set(rng.sample(range(NUM_STREAMS), NUM_STREAMS // 2))
    ways = ("task", "aclose", "break")

    async def main() -> None:
        async with echo_engine(echo_step_s=0.001, max_num_batched_tokens=8192) as engine:
            prompts = [f"request {i} asks for {'more ' * (i % 7)}text" for i in range(NUM_STREAMS)]
            reached = [asyncio.Event() for _ in range(NUM_STREAMS)]

            async def consume(i: int, stream: RequestStream) -> list[int]:
                way = ways[i % 3] if i in cancelled else None
                stop_after = rng.randrange(1, 6)
                ids: list[int] = []
                async for out in stream:
                    ids.extend(out.token_ids)
                    if way is not None and len(ids) >= stop_after:
                        if way == "aclose":
                            await stream.aclose()
                            break
                        if way == "break":
                            break
                        reached[i].set()  # "task": keep reading until cancelled
                return ids

            streams = []
            for i, prompt in enumerate(prompts):
                max_tokens = ENDLESS if i in cancelled else SHORT
                streams.append(engine.stream(prompt, ignore_eos=True, max_tokens=max_tokens))
            tasks = [asyncio.create_task(consume(i, s)) for i, s in enumerate(streams)]
            by_task = [i for i in cancelled if ways[i % 3] == "task"]
            await asyncio.wait_for(asyncio.gather(*(reached[i].wait() for i in by_task)), WAIT_S)
            for i in by_task:
                tasks[i].cancel()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
            for i, result in enumerate(results):
                if i not in cancelled:
                    assert result == cycled_ids(prompt_ids(engine, prompts[i]), SHORT)
                elif ways[i % 3] == "task":
                    assert isinstance(result, asyncio.CancelledError)
                else:
                    assert isinstance(result, list)
                    assert 0 < len(result) < ENDLESS
            await assert_drained(engine)
            assert engine.stats()["num_steps"] < ENDLESS  # counted, not timed: no abort missed
            assert core_of(engine).scheduler.get_request(streams[0].request_id) is None

    run(main())


def test_finished_aborted_stopped_and_failed_requests_together_leave_no_state() -> None:
    async def main() -> None:
        async with echo_engine(
            echo_step_s=0.001, max_stream_backlog_bytes=64, max_num_batched_tokens=8192
        ) as engine:
            long_prompt = "slow readers fall behind " * 4
            finished = [engine.stream(f"finishes {i}", max_tokens=None) for i in range(30)]
            stopped = [
                engine.stream(f"stops at the word halt {i}", stop=["halt"]) for i in range(30)
            ]
            aborted = [
                engine.stream(f"aborted {i}", ignore_eos=True, max_tokens=ENDLESS, n=1 + i % 3)
                for i in range(30)
            ]
            slow = [
                engine.stream(long_prompt, ignore_eos=True, max_tokens=ENDLESS) for _ in range(5)
            ]
            release = asyncio.Event()

            async def read_one_then_block(stream: RequestStream) -> None:
                async for _ in stream:
                    await release.wait()

            async def read_two_then_leave(stream: RequestStream) -> None:
                async for out in stream:
                    if out.token_ids:
                        break

            slow_tasks = [asyncio.create_task(read_one_then_block(s)) for s in slow]
            outs = await asyncio.gather(*finished, *stopped)
            await asyncio.gather(*(read_two_then_leave(s) for s in aborted))
            assert all(o.finish_reason == "stop" for o in outs)
            assert all(o.stop_reason == "halt" for o in outs[30:])
            await wait_until(
                lambda: num_live_states(engine)[1] == 0, what="slow readers to be failed"
            )
            release.set()
            errors = await asyncio.gather(*slow_tasks, return_exceptions=True)
            assert all(isinstance(e, SlowConsumerError) for e in errors), errors
            await assert_drained(engine)
            assert engine.stats()["num_steps"] < ENDLESS  # counted, not timed: no abort missed

    run(main())


def test_aborting_a_request_that_waits_in_the_queue_frees_it() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            with RunnerGate(engine) as gate:
                gate.close()
                first = engine.stream("this one is in the blocked step", max_tokens=None)
                await wait_event(gate.entered)  # the step holding `first` is stuck in execute()
                queued = engine.stream("never scheduled: the engine is blocked", max_tokens=None)
                reader = asyncio.create_task(_await(queued))
                await asyncio.sleep(0)  # the reader now waits on its collector
                assert num_live_states(engine) == (2, 2)
                assert engine.stats()["num_queued"] == 2
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                await first.aclose()
                assert num_live_states(engine) == (0, 0)
                assert engine.stats()["num_queued"] == 0
            await assert_drained(engine)
            # The engine still serves afterwards.
            out = await engine.stream("still alive", max_tokens=None)
            assert out.text == echo_text(engine, "still alive")

    run(main())


async def _await(stream: RequestStream) -> Any:
    return await stream


def test_a_request_is_registered_before_its_add_leaves_for_the_engine() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            core = core_of(engine)
            real_add = core.add_request
            seen: list[str] = []

            def check_registered(request: Request) -> None:
                bridges = bridges_of(engine)
                states = [b.processor.states.get(request.request_id) for b in bridges]
                state = next(s for s in states if s is not None)
                assert any(
                    b.processor.parents.get(state.parent.request_id) is state.parent
                    for b in bridges
                )
                seen.append(request.request_id)
                real_add(request)

            core.add_request = check_registered  # type: ignore[method-assign]
            one = engine.stream("first request on a fresh loop", request_id="one")
            two = engine.stream("three choices", n=3, request_id="two")
            await asyncio.gather(one, two)
            assert seen[0] == engine_ids(one)[0] and seen[0].endswith(":one")
            assert sorted(seen[1:]) == engine_ids(two)
            assert [i.split(":", 1)[1] for i in engine_ids(two)] == ["two#0", "two#1", "two#2"]

    run(main())


def test_outputs_for_unknown_ids_are_dropped() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            await engine.stream("creates this loop's bridge")
            bogus = EngineCoreOutputs(
                outputs=[EngineCoreOutput("nobody", [5, 6]), EngineCoreOutput("gone#1", [7])]
            )
            await asyncio.to_thread(dispatcher_of(engine).post, bogus)
            await wait_until(
                lambda: all(not b._batches for b in bridges_of(engine)),
                what="the bogus batch to be handled",
            )
            assert num_live_states(engine) == (0, 0)
            out = await engine.stream("still fine", max_tokens=None)
            assert out.text == echo_text(engine, "still fine")

    run(main())


def test_aclose_from_another_task_ends_the_reader() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            stream = engine.stream("read elsewhere", ignore_eos=True, max_tokens=ENDLESS)
            first = asyncio.Event()

            async def reader() -> int:
                count = 0
                async for _ in stream:
                    count += 1
                    first.set()
                return count

            task = asyncio.create_task(reader())
            await asyncio.wait_for(first.wait(), WAIT_S)
            await stream.aclose()
            try:
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            except asyncio.TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise AssertionError("the reader still waits after aclose()") from None
            except Exception:
                pass  # ending with an error is fine; hanging is not
            await assert_drained(engine)

    run(main())


def test_aclose_is_idempotent_and_a_finished_stream_sends_no_abort() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            core = core_of(engine)
            aborted: list[list[str]] = []
            real_abort = core.abort
            core.abort = lambda ids: (aborted.append(list(ids)), real_abort(ids))  # type: ignore[method-assign]
            stream = engine.stream("done before close", max_tokens=None)
            await stream
            await stream.aclose()
            await stream.aclose()
            assert aborted == []
            other = engine.stream("closed twice", params=SamplingParams(max_tokens=None))
            await other.aclose()
            await other.aclose()
            assert aborted == [engine_ids(other)]
            await assert_drained(engine)

    run(main())


def test_fail_ends_the_reader_with_the_error_and_frees_the_request() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            stream = engine.stream("stopped by its server", ignore_eos=True, max_tokens=ENDLESS)
            error = EngineClosedError("the server is shutting down")
            outputs = 0
            try:
                async for _ in stream:
                    outputs += 1
                    if outputs == 1:
                        stream.fail(error)
            except EngineClosedError as e:
                assert e is error
            else:
                raise AssertionError("the reader did not get the error")
            assert outputs == 1
            await assert_drained(engine)  # the reader left: the request was aborted
            stream.fail(error)  # a stream that ended: nothing happens

    run(main())
