"""Engine-wide metrics: ``stats()`` keys and values after traffic, and the Prometheus collector
registered on a caller's registry (no global state)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inlinelm.sched.runner import ModelRunnerOutput
from tests.helpers import bridges_of
from tests.runtime.helpers import (
    WAIT_S,
    assert_drained,
    echo_engine,
    run,
    runner_of,
)

STATS_KEYS = {
    "num_running",
    "num_waiting",
    "num_queued",
    "kv_blocks_used",
    "kv_blocks_total",
    "prefix_cache_hit_rate",
    "prefix_cache_hit_tokens",
    "prefix_cache_queried_tokens",
    "num_steps",
    "num_merged_outputs",
    "num_coalesced_steps",
    "finished",
    "histograms",
    "grammar_cache_hits",
    "grammar_cache_misses",
    "grammar_compiles_abandoned",
    "grammar_cache_entries",
    "grammar_cache_bytes",
}
HISTOGRAMS = {
    "step_duration_seconds",
    "event_loop_lag_seconds",
    "ttft_seconds",
    "itl_seconds",
    "e2e_seconds",
    "http_ttft_seconds",
    "http_itl_seconds",
}
LONG_PROMPT = "a prompt long enough to fill a few KV blocks of sixteen tokens each " * 3


def test_stats_before_start_are_zero_and_complete() -> None:
    engine = echo_engine()
    stats = engine.stats()
    assert set(stats) == STATS_KEYS
    assert set(stats["histograms"]) == HISTOGRAMS
    assert stats["num_steps"] == 0
    assert stats["kv_blocks_total"] == 0
    assert stats["finished"] == {}
    engine.close()


def test_stats_after_some_requests() -> None:
    async def main() -> None:
        async with echo_engine(echo_step_s=0.001) as engine:
            await asyncio.gather(
                *(engine.stream(f"request {i}", max_tokens=None) for i in range(8))
            )
            await engine.stream(LONG_PROMPT, max_tokens=4)
            await engine.stream(LONG_PROMPT, max_tokens=4)  # hits the prefix cache
            stream = engine.stream("aborted", ignore_eos=True, max_tokens=5000)
            async for _ in stream:
                break
            await assert_drained(engine)
            stats = engine.stats()
            assert set(stats) == STATS_KEYS
            assert stats["num_running"] == stats["num_waiting"] == stats["num_queued"] == 0
            assert stats["kv_blocks_used"] == 0
            assert stats["kv_blocks_total"] == engine.num_kv_blocks > 0
            assert 0.0 < stats["prefix_cache_hit_rate"] <= 1.0
            hits, queried = stats["prefix_cache_hit_tokens"], stats["prefix_cache_queried_tokens"]
            assert 0 < hits <= queried
            assert stats["prefix_cache_hit_rate"] == hits / queried
            assert stats["finished"] == {"stop": 8, "length": 2, "abort": 1}
            assert stats["num_steps"] > 10
            assert stats["num_merged_outputs"] >= 0
            hist = stats["histograms"]
            assert hist["ttft_seconds"]["count"] == 10
            assert hist["e2e_seconds"]["count"] == 10
            assert hist["itl_seconds"]["count"] > 10
            assert 0 < hist["step_duration_seconds"]["count"] <= stats["num_steps"] + 2
            assert hist["event_loop_lag_seconds"]["count"] == hist["step_duration_seconds"]["count"]
            assert hist["step_duration_seconds"]["mean"] >= 0.0005
            buckets = hist["ttft_seconds"]["buckets"]
            assert list(buckets.values()) == sorted(buckets.values())
            assert buckets["inf"] == 10

    run(main())


def test_prometheus_collector_on_a_callers_registry() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            registry = CollectorRegistry()
            engine.register_metrics(registry)
            await asyncio.gather(
                *(engine.stream(f"scraped {i}", max_tokens=None) for i in range(5))
            )
            text = generate_latest(registry).decode()
            for name in (
                "inlinelm_num_running",
                "inlinelm_num_waiting",
                "inlinelm_num_queued",
                "inlinelm_kv_blocks_used",
                "inlinelm_kv_blocks_total",
                "inlinelm_prefix_cache_hit_rate",
                "inlinelm_steps_total",
                "inlinelm_coalesced_outputs_total",
                'inlinelm_requests_finished_total{reason="stop"}',
                "inlinelm_ttft_seconds_bucket",
                "inlinelm_itl_seconds_bucket",
                "inlinelm_e2e_seconds_count",
                "inlinelm_step_duration_seconds_sum",
                "inlinelm_event_loop_lag_seconds_bucket",
            ):
                assert name in text, name
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }
            assert samples[("inlinelm_ttft_seconds_count", ())] == 5
            assert samples[("inlinelm_ttft_seconds_bucket", (("le", "+Inf"),))] == 5
            assert samples[("inlinelm_requests_finished_total", (("reason", "stop"),))] == 5
            assert samples[("inlinelm_kv_blocks_total", ())] == engine.num_kv_blocks
            assert samples[("inlinelm_steps_total", ())] == engine.stats()["num_steps"]
            # Nothing went to the global registry.
            assert "inlinelm_num_running" not in generate_latest(REGISTRY).decode()
            # A second engine registers on its own registry without clashing.
            other = echo_engine()
            other_registry = CollectorRegistry()
            other.register_metrics(other_registry)
            assert "inlinelm_steps_total 0.0" in generate_latest(other_registry).decode()
            other.close()

    run(main())


class LoopLag:
    """Blocks the event loop (a slow callback) while the engine takes ``num_steps`` more steps,
    counting the batches posted to the loop's bridge and the wake-ups sent to the loop."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps
        self.posts = 0
        self.wakes = 0
        self.posts_while_blocked = 0
        self.wakes_while_blocked = 0

    async def run(self) -> dict[str, Any]:
        async with echo_engine(echo_step_s=0.001) as engine:
            stream = engine.stream("a lagging loop", ignore_eos=True, max_tokens=1000)
            runner = runner_of(engine)
            collect = runner.collect
            steps_done = threading.Event()
            target = [0]

            def counting() -> ModelRunnerOutput:
                out: ModelRunnerOutput = collect()
                target[0] -= 1
                if target[0] == 0:
                    steps_done.set()
                return out

            reads = 0
            async for _ in stream:
                reads += 1
                if reads == 1:
                    bridge = bridges_of(engine)[0]
                    self._count(bridge)
                    target[0] = self.num_steps + 1
                    runner.collect = counting
                    # NOTE: a deliberate blocking wait on the loop: the loop lags.
                    assert steps_done.wait(WAIT_S)
                    self.posts_while_blocked = self.posts
                    self.wakes_while_blocked = self.wakes
                if reads == 2:
                    break
            await assert_drained(engine)
            return engine.stats()

    def _count(self, bridge: Any) -> None:
        post, loop = bridge.post, bridge.loop
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting_post(batch: Any) -> bool:
            self.posts += 1
            ok: bool = post(batch)
            return ok

        def counting_call(callback: Any, *args: Any, **kwargs: Any) -> Any:
            if callback == bridge._ready.set:
                self.wakes += 1
            return call_soon_threadsafe(callback, *args, **kwargs)

        bridge.post = counting_post
        loop.call_soon_threadsafe = counting_call


def test_a_lagging_loop_is_woken_once_for_many_steps() -> None:
    lag = LoopLag(num_steps=10)
    stats = run(lag.run())
    assert lag.posts_while_blocked >= 10
    assert lag.wakes_while_blocked <= 1
    assert stats["num_coalesced_steps"] > 0


def test_coalesced_steps_never_exceed_the_steps_taken() -> None:
    lag = LoopLag(num_steps=10)
    stats = run(lag.run())
    assert lag.posts_while_blocked >= 10
    assert stats["num_coalesced_steps"] <= stats["num_steps"]
