"""RequestOutputCollector: one slot that never blocks; merges in delta mode, replaces otherwise,
lets exceptions win, and counts every merge (DESIGN invariant 4)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from inlinelm.errors import SlowConsumerError
from inlinelm.runtime.collector import BACKLOG_WARNING_MERGES, RequestOutputCollector
from inlinelm.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inlinelm.sched.output import TokenLogprobs


def output(
    *choices: tuple[int, str, list[int]],
    finished: bool = False,
    metrics: RequestMetrics | None = None,
    finish_reason: str | None = None,
    logprobs: bool = False,
) -> RequestOutput:
    """A ``RequestOutput`` with one choice per ``(index, text, token_ids)``."""
    outs = [
        CompletionOutput(
            index,
            text,
            list(ids),
            finish_reason,
            None,
            [TokenLogprobs([t], [-0.5], 1) for t in ids] if logprobs else None,
        )
        for index, text, ids in choices
    ]
    return RequestOutput("r", outs, finished, [1, 2, 3], metrics or RequestMetrics(0.0))


def collector(*, delta: bool = True, max_backlog: int = 1 << 20) -> RequestOutputCollector:
    return RequestOutputCollector(delta=delta, max_backlog_bytes=max_backlog)


def test_empty_slot_gives_none_and_one_put_gives_that_output() -> None:
    c = collector()
    assert c.get_nowait() is None
    first = output((0, "ab", [5, 6]))
    assert c.put(first)
    assert c.get_nowait() is first
    assert c.get_nowait() is None
    assert c.num_merges == 0


def test_delta_mode_concatenates_text_ids_and_logprobs_and_counts_the_merge() -> None:
    c = collector()
    metrics = RequestMetrics(0.0)
    c.put(output((0, "Hel", [10, 11]), metrics=metrics, logprobs=True))
    c.put(output((0, "lo", [12]), metrics=metrics, logprobs=True))
    c.put(output((0, "!", [2]), metrics=metrics, finished=True, finish_reason="stop"))
    merged = c.get_nowait()
    assert merged is not None
    assert merged.text == "Hello!"
    assert merged.token_ids == [10, 11, 12, 2]
    assert merged.logprobs is not None
    assert [lp.token_ids[0] for lp in merged.logprobs] == [10, 11, 12]
    assert merged.finished
    assert merged.finish_reason == "stop"
    assert c.num_merges == 2
    assert metrics.num_merged_outputs == 2
    assert c.get_nowait() is None


def test_delta_mode_keeps_each_choice_index_apart() -> None:
    c = collector()
    c.put(output((0, "a", [1])))
    c.put(output((1, "x", [7])))
    c.put(output((0, "b", [2])))
    c.put(output((2, "p", [9])))
    c.put(output((1, "y", [8])))
    merged = c.get_nowait()
    assert merged is not None
    by_index = {o.index: (o.text, o.token_ids) for o in merged.outputs}
    assert by_index == {0: ("ab", [1, 2]), 1: ("xy", [7, 8]), 2: ("p", [9])}
    assert c.num_merges == 4


def test_cumulative_mode_replaces_per_index() -> None:
    c = collector(delta=False)
    c.put(output((0, "He", [10])))
    c.put(output((1, "Yo", [20])))
    c.put(output((0, "Hello", [10, 11])))
    merged = c.get_nowait()
    assert merged is not None
    by_index = {o.index: (o.text, o.token_ids) for o in merged.outputs}
    assert by_index == {0: ("Hello", [10, 11]), 1: ("Yo", [20])}
    assert c.num_merges == 2


def test_an_exception_replaces_the_waiting_output_and_wins_over_later_ones() -> None:
    c = collector()
    c.put(output((0, "abc", [1, 2, 3])))
    error = SlowConsumerError("too slow")
    assert c.put(error)
    c.put(output((0, "d", [4])))
    with pytest.raises(SlowConsumerError) as info:
        c.get_nowait()
    assert info.value is error
    assert c.get_nowait() is None


def test_get_waits_for_a_put_from_the_loop() -> None:
    async def main() -> None:
        c = collector()
        waiter = asyncio.create_task(c.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        asyncio.get_running_loop().call_soon(c.put, output((0, "hi", [3])))
        out = await asyncio.wait_for(waiter, 5)
        assert out.text == "hi"

    asyncio.run(main())


def test_get_raises_the_exception_put_while_it_waits() -> None:
    async def main() -> None:
        c = collector()
        waiter = asyncio.create_task(c.get())
        await asyncio.sleep(0)
        c.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await asyncio.wait_for(waiter, 5)

    asyncio.run(main())


def test_a_backlog_over_the_limit_reports_overflow() -> None:
    c = collector(max_backlog=10)
    assert c.put(output((0, "12345", [1])))
    assert c.put(output((0, "12345", [2])))  # exactly 10 characters wait: still fine
    assert not c.put(output((0, "6", [3])))
    assert c.backlog_bytes == 11
    c.get_nowait()
    assert c.backlog_bytes == 0
    assert c.pending_merges == 0


def test_warns_once_when_one_request_has_20_merged_outputs_pending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="inlinelm.runtime.collector")
    c = collector()
    c.put(output((0, "t", [1])))
    for i in range(BACKLOG_WARNING_MERGES - 1):
        c.put(output((0, "t", [i])))
    assert not caplog.records, "warned before the 20th merge"
    c.put(output((0, "t", [99])))
    assert len(caplog.records) == 1
    assert caplog.records[0].levelno == logging.WARNING
    assert "20" in caplog.records[0].getMessage()
    for i in range(10):
        c.put(output((0, "t", [i])))
    assert len(caplog.records) == 1, "one warning per backlog, not one per merge"
    assert BACKLOG_WARNING_MERGES == 20
    assert c.pending_merges == 30
    merged = c.get_nowait()
    assert merged is not None
    assert merged.text == "t" * 31
    assert c.num_merges == 30
