"""The output handler (invariants 2 and 3): each step's batch goes through
``OutputProcessor.process_outputs`` in slices of at most 128 outputs, and the loop runs other
tasks between slices."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import defaultdict
from typing import Any

from inlinelm.runtime.bridge import SLICE_SIZE
from tests.helpers import bridges_of
from tests.runtime.helpers import (
    WAIT_S,
    RunnerGate,
    assert_drained,
    echo_engine,
    echo_text,
    run,
    wait_event,
)

NUM_STREAMS = 300


class SliceRecorder:
    """Records each ``process_outputs`` call as (size, tick) per step; :meth:`tick` counts
    the loop turns other tasks get, so two calls with one tick had no yield between them."""

    def __init__(self, bridge: Any) -> None:
        self.slices: dict[float, list[tuple[int, int]]] = defaultdict(list)
        self.ticks = 0
        self.done = False
        self._process = bridge.processor.process_outputs
        bridge.processor.process_outputs = self._recording

    def _recording(self, outputs: list[Any], step_start: float) -> list[str]:
        self.slices[step_start].append((len(outputs), self.ticks))
        result: list[str] = self._process(outputs, step_start)
        return result

    async def tick(self) -> None:
        while not self.done:
            self.ticks += 1
            await asyncio.sleep(0)


def test_a_big_step_is_processed_in_slices_of_at_most_128_with_yields_between() -> None:
    async def main() -> None:
        async with echo_engine(max_num_seqs=512, max_num_batched_tokens=16384) as engine:
            await engine.stream("creates this loop's bridge")
            bridge = bridges_of(engine)[0]
            recorder = SliceRecorder(bridge)
            ticking = asyncio.create_task(recorder.tick())
            # One-token prompts, all admitted in the step after the blocked one: that step
            # and the next have 300 outputs each.
            prompts = [f"{i}" for i in range(NUM_STREAMS)]
            with RunnerGate(engine) as gate:
                gate.close()
                first = engine.stream("held in a blocked step", max_tokens=None)
                await wait_event(gate.entered)
                streams = [engine.stream(p, max_tokens=None) for p in prompts]
            outs = await asyncio.gather(*streams)
            await first
            recorder.done = True
            await ticking
            assert [o.text for o in outs] == [echo_text(engine, p) for p in prompts]
            sizes = [n for step in recorder.slices.values() for n, _ in step]
            assert max(sizes) == SLICE_SIZE == 128
            big_steps = [
                step for step in recorder.slices.values() if sum(n for n, _ in step) > SLICE_SIZE
            ]
            assert big_steps, "no step had more than 128 outputs"
            for step in big_steps:
                tick_marks = [t for _, t in step]
                # Other tasks ran between two slices of the same step.
                assert all(a < b for a, b in itertools.pairwise(tick_marks))
            assert_at_most_a_slice_between_yields(recorder.slices)
            await assert_drained(engine)

    run(main())


def assert_at_most_a_slice_between_yields(slices: dict[float, list[tuple[int, int]]]) -> None:
    """Outputs processed with no yield between them (same tick) number at most 128."""
    per_tick: dict[int, int] = defaultdict(int)
    for step in slices.values():
        for n, tick in step:
            per_tick[tick] += n
    assert max(per_tick.values()) <= SLICE_SIZE, per_tick


def test_the_128_budget_counts_across_the_batches_a_lagging_loop_finds() -> None:
    """A loop that lags finds several steps' batches at once; it still yields after every 128
    outputs, counted across the batches, not per batch."""

    async def main() -> None:
        async with echo_engine(max_num_seqs=256) as engine:
            await engine.stream("creates this loop's bridge")
            bridge = bridges_of(engine)[0]
            recorder = SliceRecorder(bridge)
            queued = threading.Event()
            real_post = bridge.post

            def post(batch: Any) -> bool:
                ok = real_post(batch)
                if len(bridge._batches) >= 4:
                    queued.set()
                return ok

            bridge.post = post  # type: ignore[method-assign]
            ticking = asyncio.create_task(recorder.tick())
            prompts = [f"{i}" for i in range(100)]
            streams = [engine.stream(p, ignore_eos=True, max_tokens=8) for p in prompts]
            # NOTE: the loop is held on purpose until four steps (of 100 outputs) wait for it.
            assert queued.wait(WAIT_S), "the engine never got four steps ahead of the loop"
            outs = await asyncio.gather(*streams)
            recorder.done = True
            await ticking
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
            assert max(len(step) for step in recorder.slices.values()) >= 1
            assert sum(n for step in recorder.slices.values() for n, _ in step) >= 400
            assert_at_most_a_slice_between_yields(recorder.slices)
            await assert_drained(engine)

    run(main())
