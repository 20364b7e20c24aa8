"""The sync API and many event loops: ``generate`` from a script, a worker thread and inside a
running loop (Jupyter style); repeated ``asyncio.run`` on one engine; two loops served at once,
each receiving only its own outputs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from inlinelm import Engine, RequestOutput, SamplingParams
from tests.helpers import bridges_of
from tests.runtime.helpers import (
    WAIT_S,
    assert_drained,
    echo_engine,
    echo_text,
    prompt_ids,
    run,
)

PROMPTS = [f"synchronous prompt number {i}" for i in range(12)]
PARAMS = SamplingParams(max_tokens=None)


def check_outputs(engine: Engine, prompts: list[str], outs: list[RequestOutput]) -> None:
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finished
        assert out.text == echo_text(engine, prompt)


def in_thread(target: Any) -> Any:
    """Run ``target()`` on a fresh thread; return its result or raise its error."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            result.append(target())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=body, name="test-worker")
    thread.start()
    thread.join(WAIT_S * 2)
    assert not thread.is_alive(), "the worker thread hangs"
    if errors:
        raise errors[0]
    return result[0]


def test_generate_from_a_plain_script_starts_the_engine_and_returns_in_order() -> None:
    engine = echo_engine()
    try:
        outs = engine.generate(PROMPTS, PARAMS)  # progress bar on, as a script would see it
        check_outputs(engine, PROMPTS, outs)
        single = engine.generate("just one prompt", PARAMS, use_tqdm=False)
        check_outputs(engine, ["just one prompt"], single)
        ids = prompt_ids(engine, "token ids")
        by_ids = engine.generate(ids, PARAMS, use_tqdm=False)
        assert by_ids[0].token_ids[:-1] == ids
    finally:
        engine.close()


def test_generate_from_a_worker_thread() -> None:
    engine = echo_engine()
    engine.start_sync()
    try:
        outs = in_thread(lambda: engine.generate(PROMPTS, PARAMS, use_tqdm=False))
        check_outputs(engine, PROMPTS, outs)
        # Two worker threads at once.
        both = [
            in_thread(lambda: engine.generate(PROMPTS[:6], PARAMS, use_tqdm=False)),
            in_thread(lambda: engine.generate(PROMPTS[6:], PARAMS, use_tqdm=False)),
        ]
        check_outputs(engine, PROMPTS, [*both[0], *both[1]])
    finally:
        engine.close()


def test_generate_inside_a_running_loop_like_a_jupyter_cell() -> None:
    async def cell() -> None:
        engine = echo_engine()
        # A notebook cell: a loop runs, and the user calls the sync API anyway.
        outs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        check_outputs(engine, PROMPTS, outs)
        # The same engine then streams on the notebook's own loop.
        out = await engine.stream("and now async", max_tokens=None)
        assert out.text == echo_text(engine, "and now async")
        outs = engine.generate(PROMPTS[:3], PARAMS, use_tqdm=False)
        check_outputs(engine, PROMPTS[:3], outs)
        await assert_drained(engine)
        await engine.aclose()

    run(cell())


def test_two_asyncio_runs_share_one_engine_started_in_the_first() -> None:
    engine = echo_engine()

    async def first() -> None:
        await engine.start()
        out = await engine.stream("from the first loop", max_tokens=None)
        assert out.text == echo_text(engine, "from the first loop")

    async def second() -> None:
        outs = await asyncio.gather(*(engine.stream(p, max_tokens=None) for p in PROMPTS))
        check_outputs(engine, PROMPTS, list(outs))
        bridges = bridges_of(engine)
        assert [b.loop for b in bridges] == [asyncio.get_running_loop()]
        await assert_drained(engine)

    try:
        run(first())
        run(second())
        run(second())
    finally:
        engine.close()
    assert not engine.is_ready


def test_one_engine_serves_two_loops_at_once_each_getting_its_own_outputs() -> None:
    engine = echo_engine(echo_step_s=0.001)
    engine.start_sync()
    barrier = threading.Barrier(2, timeout=WAIT_S)
    seen_bridges: list[int] = []
    outcome: dict[str, Any] = {}

    async def serve(name: str) -> list[RequestOutput]:
        prompts = [f"loop {name} prompt {i}" for i in range(50)]
        streams = [engine.stream(p, max_tokens=None) for p in prompts]
        await asyncio.to_thread(barrier.wait)  # both loops have requests in flight now
        seen_bridges.append(len(bridges_of(engine)))
        outs = list(await asyncio.gather(*streams))
        check_outputs(engine, prompts, outs)
        assert all(s.request_id == o.request_id for s, o in zip(streams, outs, strict=True))
        await asyncio.to_thread(barrier.wait)  # neither loop closes while the other streams
        return outs

    def body(name: str) -> None:
        try:
            outcome[name] = run(serve(name), timeout=WAIT_S * 1.5)
        except BaseException as e:
            outcome[name] = e

    threads = [threading.Thread(target=body, args=(n,), name=f"loop-{n}") for n in "AB"]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 2)
        assert not any(t.is_alive() for t in threads), "a loop hangs"
        for name in "AB":
            assert not isinstance(outcome[name], BaseException), outcome[name]
        assert seen_bridges == [2, 2]
        # Both loops are closed: their bridges are gone, and nothing is left.
        assert bridges_of(engine) == []
        assert engine.num_free_kv_blocks == engine.num_kv_blocks
    finally:
        engine.close()
