"""What an engine, its stats and a request's metrics look like in a notebook or a log line."""

from __future__ import annotations

import asyncio

from IPython.lib.pretty import pretty

from inlinelm.runtime.outputs import RequestMetrics
from tests.runtime.helpers import echo_engine, run


def test_repr_of_an_engine_says_what_it_serves_and_its_state() -> None:
    async def main() -> None:
        engine = echo_engine(echo_step_s=0.01)
        assert repr(engine) == "<Engine model='default' runner='echo' on cpu: not started>"
        await engine.start()
        assert repr(engine).endswith(
            f"ready, 0 running, 0 waiting, KV blocks 0/{engine.num_kv_blocks} used>"
        )
        stream = engine.stream("a long one", max_tokens=4000, ignore_eos=True)
        async for _ in stream:
            break
        assert ": ready, 1 running, 0 waiting, KV blocks " in repr(engine)
        await stream.aclose()
        await engine.aclose()
        assert repr(engine) == "<Engine model='default' runner='echo' on cpu: closed>"

    run(main())


def test_stats_stay_a_dict_and_show_as_a_short_table_in_a_notebook() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            await asyncio.gather(*(engine.stream(f"p {i}", max_tokens=3) for i in range(2)))
            stats = engine.stats()
            assert isinstance(stats, dict) and stats["num_steps"] > 0
            text = pretty(stats)
            lines = text.splitlines()
            assert lines[0].split() == ["num_running", "0"]
            assert any(line.split()[:2] == ["finished", "length"] for line in lines)
            assert any(line.startswith("ttft ") and "2 × mean" in line for line in lines)
            assert len(lines) < 40 and "buckets" not in text
            html = stats._repr_html_()
            assert html.count("<tr>") == len(lines) + 1
            assert "<td>num_steps</td>" in html

    run(main())


def test_request_metrics_repr_summarises_the_latencies() -> None:
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.25, finished_time=3.0)
    metrics.inter_token_latencies = [0.001] * 5000
    text = repr(metrics)
    assert text == (
        "RequestMetrics(ttft=250.00 ms, tpot=1.00 ms, e2e=2000.00 ms, "
        "inter_token_latencies=[5000 values], num_merged_outputs=0)"
    )
