"""Failure and overload: engine-thread death (invariant 8), a stuck step, slow consumers
(invariant 9): a slow reader costs only its own latency, and one that falls too far behind
gets ``SlowConsumerError`` while the others finish."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inlinelm import EngineDeadError, RequestOutput, RequestStream, SlowConsumerError
from inlinelm.errors import EngineError
from inlinelm.runtime.collector import RequestOutputCollector
from tests.helpers import bridges_of, core_of, loaded_or_none
from tests.runtime.helpers import (
    WAIT_S,
    RunnerFailure,
    RunnerGate,
    assert_drained,
    cycled_ids,
    echo_engine,
    echo_text,
    num_live_states,
    prompt_ids,
    run,
    wait_event,
    wait_until,
)

NUM_WAITING = 200
AT_ONCE_S = WAIT_S / 10
"""Death is pushed to every stream, not noticed later: ~0.03 s for 200 streams on a loaded
2-core machine, where a stream the death misses would wait out ``WAIT_S``."""


def test_engine_death_reaches_all_200_waiting_streams_at_once() -> None:
    async def main() -> None:
        # 200 streams, at most 64 running: the rest wait in the scheduler's queue.
        engine = echo_engine(echo_step_s=0.002, max_num_seqs=64)
        await engine.start()
        failure = RunnerFailure(engine)
        started = [asyncio.Event() for _ in range(NUM_WAITING)]

        async def consume(i: int, stream: RequestStream) -> tuple[BaseException, float]:
            try:
                async for _ in stream:
                    started[i].set()
            except BaseException as e:
                return e, time.perf_counter()
            raise AssertionError("the stream ended normally")

        streams = [
            engine.stream(f"waiting stream {i}", ignore_eos=True, max_tokens=5000)
            for i in range(NUM_WAITING)
        ]
        tasks = [asyncio.create_task(consume(i, s)) for i, s in enumerate(streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[:64])), WAIT_S)
        assert engine.healthy
        failure.arm()
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        assert failure.failed_at is not None
        for error, at in results:
            assert isinstance(error, EngineDeadError)
            assert error.__cause__ is failure.error
            assert at - failure.failed_at < AT_ONCE_S
        assert not all(e.is_set() for e in started), "no stream was still waiting in the queue"
        assert num_live_states(engine) == (0, 0)

        # The engine reports dead, refuses new work at once, and closes without hanging.
        assert not engine.healthy
        ok, reason = engine.health()
        assert not ok
        assert reason.startswith("dead")
        assert "device fell over" in reason
        with pytest.raises(EngineDeadError) as info:
            engine.stream("refused at once")
        assert info.value.__cause__ is failure.error
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(asyncio.to_thread(engine.generate, ["x"], use_tqdm=False), 10)
        assert isinstance(engine.stats(), dict)
        await asyncio.wait_for(engine.aclose(), WAIT_S)
        loaded = loaded_or_none(engine)
        assert loaded is None or not loaded.core.is_alive

    run(main())


def test_death_reaches_the_streams_of_every_loop() -> None:
    engine = echo_engine(echo_step_s=0.001)
    engine.start_sync()
    failure = RunnerFailure(engine)
    barrier = threading.Barrier(3, timeout=WAIT_S)
    errors: dict[str, BaseException] = {}

    async def serve(name: str) -> None:
        streams = [
            engine.stream(f"loop {name} stream {i}", ignore_eos=True, max_tokens=5000)
            for i in range(20)
        ]
        await asyncio.to_thread(barrier.wait)  # every loop has streams in flight
        results = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results

    def body(name: str) -> None:
        try:
            run(serve(name), timeout=WAIT_S * 1.5)
        except BaseException as e:
            errors[name] = e

    threads = [threading.Thread(target=body, args=(n,), name=f"loop-{n}") for n in "AB"]
    try:
        for t in threads:
            t.start()
        barrier.wait()
        failure.arm()
        for t in threads:
            t.join(WAIT_S * 2)
        assert not any(t.is_alive() for t in threads), "a loop hangs after the engine died"
        assert errors == {}
        assert not engine.healthy
    finally:
        engine.close()


def test_chat_on_a_dead_engine_raises_engine_dead_error() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            failure = RunnerFailure(engine)
            stream = engine.stream("dies", ignore_eos=True, max_tokens=5000)
            failure.arm()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(stream, WAIT_S)
            with pytest.raises(EngineDeadError):
                engine.chat([{"role": "user", "content": "refused"}])

    run(main())


def test_death_while_a_stream_is_not_yet_iterated_raises_on_first_read() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            failure = RunnerFailure(engine)
            stream = engine.stream("created, not read yet", ignore_eos=True, max_tokens=5000)
            failure.arm()
            with pytest.raises(EngineError) as info:
                await asyncio.wait_for(stream, WAIT_S)
            assert isinstance(info.value, EngineDeadError)
            assert info.value.__cause__ is failure.error
            assert num_live_states(engine) == (0, 0)

    run(main())


def test_a_step_longer_than_step_timeout_marks_the_engine_stuck_until_it_returns() -> None:
    async def main() -> None:
        # A 1 ms step is never 1 s late, even on a loaded machine: "ok" before the gate holds.
        async with echo_engine(echo_step_s=0.001, step_timeout_s=1.0) as engine:
            stream = engine.stream("keeps the engine busy", ignore_eos=True, max_tokens=5000)
            reads = 0
            with RunnerGate(engine) as gate:
                async for _ in stream:
                    reads += 1
                    if reads == 3:
                        assert engine.health() == (True, "ok")
                        gate.close()
                        await wait_event(gate.entered)
                        await wait_until(lambda: not engine.healthy, what="stuck to be reported")
                        ok, reason = engine.health()
                        assert not ok
                        assert reason.startswith("stuck")
                        gate.open()
                        await wait_until(lambda: engine.healthy, what="health to come back")
                    if reads == 6:
                        break
            await assert_drained(engine)
            assert engine.health() == (True, "ok")

    run(main())


def test_a_first_step_after_idle_that_blocks_is_reported_stuck() -> None:
    async def main() -> None:
        async with echo_engine(step_timeout_s=0.2) as engine:
            await engine.stream("one step finishes, then the engine idles")
            with RunnerGate(engine) as gate:
                gate.close()
                stream = engine.stream("this step never returns", max_tokens=None)
                await wait_event(gate.entered)
                try:
                    await wait_until(lambda: not engine.healthy, what="stuck")
                    assert engine.health()[1].startswith("stuck")
                finally:
                    gate.open()
            out = await asyncio.wait_for(stream, WAIT_S)
            assert out.text == echo_text(engine, "this step never returns")
            assert engine.health() == (True, "ok")

    run(main())


def test_a_slow_consumer_does_not_delay_the_others_and_its_merges_are_counted() -> None:
    prompt = " ".join(f"t{i}" for i in range(40))
    num_tokens = 120

    async def read_all(stream: RequestStream) -> list[RequestOutput]:
        return [out async for out in stream]

    async def main() -> None:
        async with echo_engine(echo_step_s=0.004) as engine:
            expected = cycled_ids(prompt_ids(engine, prompt), num_tokens)

            # 10 readers next to one that reads one output, then stops reading.
            release = asyncio.Event()
            slow = engine.stream(prompt, ignore_eos=True, max_tokens=num_tokens)
            slow_outs: list[RequestOutput] = []

            async def read_slowly() -> None:
                async for out in slow:
                    slow_outs.append(out)
                    if len(slow_outs) == 1:
                        await release.wait()

            slow_task = asyncio.create_task(read_slowly())
            # NOTE: order, not wall-clock ratios (noise on a loaded machine): every other
            # reader gets its whole answer, and the engine finishes the slow request, while
            # the slow reader still holds its first output. An engine that waited on a
            # reader would stall here until WAIT_S.
            fast = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        read_all(engine.stream(prompt, ignore_eos=True, max_tokens=num_tokens))
                        for _ in range(10)
                    )
                ),
                WAIT_S,
            )
            await wait_until(lambda: core_of(engine).stats.num_running == 0)
            assert len(slow_outs) == 1
            assert not slow_task.done()

            for outs in fast:
                assert [t for o in outs for t in o.token_ids] == expected

            release.set()
            await asyncio.wait_for(slow_task, WAIT_S)
            assert len(slow_outs) == 2  # everything it missed arrived merged into one output
            assert [t for o in slow_outs for t in o.token_ids] == expected
            merged = slow_outs[-1].metrics.num_merged_outputs
            assert merged > 0
            assert engine.stats()["num_merged_outputs"] > 0
            await assert_drained(engine)

    run(main())


def test_stats_count_every_merge_of_a_finished_request() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002) as engine:
            stream = engine.stream("read once, then only at the end", max_tokens=None)
            outs = []
            release = asyncio.Event()
            async for out in stream:
                outs.append(out)
                if len(outs) == 1:
                    await wait_until(lambda: num_live_states(engine) == (0, 0))
                    release.set()
            merged = outs[-1].metrics.num_merged_outputs
            assert merged > 0
            assert engine.stats()["num_merged_outputs"] == merged

    run(main())


def test_a_reader_past_the_backlog_limit_gets_slow_consumer_error_and_others_finish() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.002, max_stream_backlog_bytes=200) as engine:
            long_prompt = "a slow reader lets this text pile up " * 2
            slow = engine.stream(long_prompt, ignore_eos=True, max_tokens=2000)
            release = asyncio.Event()
            collector: list[RequestOutputCollector] = []

            async def read_one_then_block() -> int:
                count = 0
                async for _ in slow:
                    count += 1
                    if count == 1:
                        collector.append(
                            bridges_of(engine)[0].processor.parents[slow.request_id].collector
                        )
                        await release.wait()
                return count

            slow_task = asyncio.create_task(read_one_then_block())
            others = [engine.stream(f"others go on {i}", max_tokens=None) for i in range(20)]
            outs = await asyncio.gather(*others)
            for i, out in enumerate(outs):
                assert out.text == echo_text(engine, f"others go on {i}")
            # The slow request is failed and aborted on the engine while its reader sleeps.
            await wait_until(lambda: slow.request_id not in bridges_of(engine)[0].processor.parents)
            await assert_drained(engine)
            release.set()
            with pytest.raises(SlowConsumerError):
                await asyncio.wait_for(slow_task, WAIT_S)
            assert collector[0].num_merges > 0
            # The engine still serves.
            again = await engine.stream("after the overflow", max_tokens=None)
            assert again.text == echo_text(engine, "after the overflow")

    run(main())


def test_the_backlog_limit_counts_bytes_not_characters() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001, max_stream_backlog_bytes=300) as engine:
            prompt = "日本語のテキスト" * 4  # 3 bytes per character
            full = engine.tokenizer.decode(
                cycled_ids(prompt_ids(engine, prompt), 300), skip_special_tokens=True
            )
            assert len(full) < 300 < len(full.encode())  # fits in characters, not in bytes
            stream = engine.stream(prompt, ignore_eos=True, max_tokens=300)
            outs = []

            async def read_one_then_wait() -> None:
                async for out in stream:
                    outs.append(out)
                    if len(outs) == 1:
                        await wait_until(lambda: num_live_states(engine) == (0, 0))

            with pytest.raises(SlowConsumerError):
                await asyncio.wait_for(read_one_then_wait(), WAIT_S)

    run(main())
