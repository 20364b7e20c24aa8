"""Engine life cycle: lazy start, idempotent close, streams open at close, use after close,
and engines created and closed one after another leaving no threads and no memory."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import weakref
from pathlib import Path

import pytest

from inlinelm import Engine, EngineClosedError, RequestStream
from inlinelm.errors import EngineError
from tests.helpers import core_of
from tests.runtime.helpers import (
    WAIT_S,
    RunnerGate,
    echo_engine,
    echo_text,
    run,
    runner_of,
    wait_event,
    wait_until,
)

ENGINE_THREADS = ("inlinelm-engine", "inlinelm-loader")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_constructing_an_engine_does_no_heavy_work() -> None:
    before = set(threading.enumerate())
    engine = echo_engine()
    assert not engine.is_ready
    assert engine.health() == (False, "starting")
    assert engine._start_future is None
    assert set(threading.enumerate()) <= before
    engine.close()
    engine.close()
    assert engine.health() == (False, "closed")


def test_start_is_idempotent_and_reports_ready_only_when_warm() -> None:
    async def main() -> None:
        engine = echo_engine()
        first = asyncio.create_task(engine.start())
        second = asyncio.create_task(engine.start())
        await asyncio.gather(first, second)
        assert engine.is_ready
        assert engine.health() == (True, "ok")
        assert engine.num_free_kv_blocks == engine.num_kv_blocks > 0
        assert engine.max_model_len > 0
        core = core_of(engine)
        assert core.is_alive
        await engine.aclose()
        assert not core.is_alive, "aclose() did not join the engine thread"

    run(main())


def test_start_reports_progress_in_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inlinelm")

    async def main() -> None:
        async with echo_engine(num_kv_blocks=64, max_model_len=1024):
            pass

    run(main())
    messages = [r.getMessage() for r in caplog.records if r.name == "inlinelm"]
    assert any("tokenizer loaded" in m for m in messages), messages
    # One INFO line says the engine is ready: which model, where, its KV cache, how long.
    (ready,) = [m for m in messages if m.startswith("engine ready in ")]
    assert "s: model default on cpu (echo runner)" in ready, ready
    assert "64 KV blocks of 16 tokens" in ready, ready


def test_aclose_is_idempotent_and_everything_after_it_raises_engine_closed_error() -> None:
    async def main() -> None:
        engine = echo_engine()
        async with engine:
            out = await engine.stream("before close", max_tokens=None)
            assert out.text == echo_text(engine, "before close")
        await engine.aclose()
        engine.close()
        assert not engine.is_ready
        assert not engine.healthy
        assert engine.health() == (False, "closed")
        with pytest.raises(EngineClosedError):
            engine.stream("after close")
        with pytest.raises(EngineClosedError):
            await engine.start()
        with pytest.raises(EngineClosedError):
            engine.chat([{"role": "user", "content": "after close"}])
        with pytest.raises(EngineClosedError):
            await asyncio.to_thread(engine.generate, ["after close"], use_tqdm=False)
        assert isinstance(EngineClosedError("x"), EngineError)

    run(main())


def test_streams_open_at_close_get_engine_closed_error() -> None:
    async def main() -> None:
        engine = echo_engine(echo_step_s=0.002)
        await engine.start()
        started = [asyncio.Event() for _ in range(10)]

        async def consume(i: int, stream: RequestStream) -> BaseException | None:
            try:
                async for _ in stream:
                    started[i].set()
            except BaseException as e:
                return e
            return None

        streams = [
            engine.stream(f"open at close {i}", ignore_eos=True, max_tokens=5000) for i in range(10)
        ]
        tasks = [asyncio.create_task(consume(i, s)) for i, s in enumerate(streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
        core = core_of(engine)
        await asyncio.wait_for(engine.aclose(), WAIT_S)
        errors = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        assert all(isinstance(e, EngineClosedError) for e in errors), errors
        assert not core.is_alive
        assert core.stats.num_free_blocks == core.stats.num_kv_blocks

    run(main())


def test_close_from_sync_code_after_the_loop_ended() -> None:
    engine = echo_engine()

    async def use() -> None:
        await engine.stream("then the loop ends")

    run(use())
    core = core_of(engine)
    engine.close()
    assert not core.is_alive


def test_close_returns_when_it_arrives_in_the_step_that_aborts_the_last_request() -> None:
    async def main() -> None:
        engine = echo_engine()
        await engine.start()
        core = core_of(engine)
        closer = threading.Thread(target=engine.close, name="test-closer", daemon=True)
        try:
            with RunnerGate(engine) as gate:
                stream = engine.stream("the last request", ignore_eos=True, max_tokens=5000)
                reader = stream.__aiter__()
                await reader.__anext__()
                gate.close()
                await wait_event(gate.entered)  # a step holding the request is in execute()
                await reader.aclose()  # the reader leaves: ABORT queued mid-step …
                closer.start()  # … then SHUTDOWN
                await wait_until(lambda: core._inputs.qsize() >= 2, what="abort and shutdown")
            await asyncio.to_thread(closer.join, 3.0)
            assert not closer.is_alive(), "close() hangs: the engine thread never exits"
        finally:
            core.shutdown()  # if close() hung, this frees the thread so nothing is left behind
            await asyncio.to_thread(closer.join, WAIT_S)

    run(main())


def test_close_frees_the_runner_even_while_the_engine_object_lives() -> None:
    engine = echo_engine()

    async def main() -> weakref.ref[object]:
        async with engine:
            await engine.stream("hold the runner")
            return weakref.ref(runner_of(engine))

    runner = run(main())
    gc.collect()
    assert not engine.is_ready
    assert runner() is None, "the runner (model weights, KV cache) outlived close()"


def test_an_engine_dropped_without_close_is_collected_and_its_thread_stops() -> None:
    async def main() -> None:
        engine = echo_engine()
        await engine.start()
        await engine.stream("a stream creates this loop's bridge")
        ref = weakref.ref(engine)
        core = core_of(engine)
        del engine
        gc.collect()
        try:
            assert ref() is None, "the output handler keeps the Engine alive"
            await wait_until(lambda: not core.is_alive, what="the engine thread")
        finally:
            leaked = ref()
            if leaked is not None:
                leaked.close()  # type: ignore[attr-defined]

    run(main())


def test_three_model_engines_in_a_row_leave_no_threads_and_return_memory(
    tiny_model_dir: Path,
) -> None:
    before = set(threading.enumerate())
    rss_after: list[int] = []

    def new_engine_threads() -> list[str]:
        return [
            t.name
            for t in threading.enumerate()
            if t not in before and t.name in ENGINE_THREADS and t.is_alive()
        ]

    async def one_engine(i: int) -> None:
        async with Engine(model=str(tiny_model_dir), runner="model") as engine:
            outs = await asyncio.gather(
                *(engine.stream(f"engine {i} prompt {j}", max_tokens=8) for j in range(3))
            )
            assert all(len(o.token_ids) > 0 for o in outs)
        # The loader thread ends right after handing its result over: wait for that moment.
        await wait_until(lambda: not new_engine_threads(), what="engine and loader threads")

    for i in range(3):
        run(one_engine(i), timeout=120)
        gc.collect()
        assert new_engine_threads() == []
        rss_after.append(rss_bytes())
    growth_mb = (rss_after[2] - rss_after[0]) / 1e6
    print(f"RSS after each engine: {[round(r / 1e6) for r in rss_after]} MB")
    assert growth_mb < 150, f"RSS grew by {growth_mb:.0f} MB from the 1st to the 3rd engine"
