"""Engine-wide metrics: counters and histograms kept on the event loops, exported as a dict
(:meth:`inlinelm.Engine.stats`) or through a Prometheus collector on a caller's registry."""

from __future__ import annotations

import bisect
import html
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inlinelm.sched.engine_core import EngineCoreStats
    from inlinelm.structured.compiler import CacheStats

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Histogram:
    """A fixed-bucket histogram (cumulative counts, sum, count), cheap to observe."""

    __slots__ = ("buckets", "count", "counts", "total")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.total += value

    def snapshot(self) -> dict[str, Any]:
        """Count, sum, mean and cumulative bucket counts keyed by upper bound."""
        cumulative, running = {}, 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += n
            cumulative[str(bound)] = running
        mean = self.total / self.count if self.count else 0.0
        return {"count": self.count, "sum": self.total, "mean": mean, "buckets": cumulative}


class EngineMetrics:
    """Counters and histograms for one engine; the router adds its HTTP-level timings."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.step_duration = Histogram()
        self.loop_lag = Histogram()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.http_ttft = Histogram()
        self.http_itl = Histogram()
        self.finished: dict[str, int] = {}
        self.num_merged_outputs = 0
        self.num_steps_seen = 0

    def observe_step(self, duration: float, lag: float) -> None:
        """One engine step's duration and how long its batch waited for the loop."""
        with self.lock:
            self.step_duration.observe(duration)
            self.loop_lag.observe(max(lag, 0.0))
            self.num_steps_seen += 1

    def observe_finished(
        self, reason: str, ttft: float | None, itls: list[float], e2e: float | None, merges: int
    ) -> None:
        """A request ended: its finish reason and latencies."""
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if ttft is not None:
                self.ttft.observe(ttft)
            for itl in itls:
                self.itl.observe(itl)
            if e2e is not None:
                self.e2e.observe(e2e)
            self.num_merged_outputs += merges

    def observe_http_ttft(self, seconds: float) -> None:
        """Time from the request reaching the router to its first frame written."""
        self.http_ttft.observe(seconds)

    def observe_http_itl(self, seconds: float) -> None:
        """Time between two frames written to one stream (per frame: kept lock-free; two
        loops observing at the same instant may, rarely, lose one count)."""
        self.http_itl.observe(seconds)

    def histograms(self) -> dict[str, Histogram]:
        return {
            "step_duration_seconds": self.step_duration,
            "event_loop_lag_seconds": self.loop_lag,
            "ttft_seconds": self.ttft,
            "itl_seconds": self.itl,
            "e2e_seconds": self.e2e,
            "http_ttft_seconds": self.http_ttft,
            "http_itl_seconds": self.http_itl,
        }


class PrometheusCollector:
    """Exposes an engine's ``stats()`` on a caller-supplied registry (no global state)."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], metrics: EngineMetrics, prefix: str = "inlinelm"
    ) -> None:
        self._stats = stats
        self._metrics = metrics
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        p, stats = self._prefix, self._stats()
        for name in (
            "num_running",
            "num_waiting",
            "kv_blocks_used",
            "kv_blocks_total",
            "prefix_cache_hit_rate",
            "num_queued",
        ):
            yield GaugeMetricFamily(f"{p}_{name}", name.replace("_", " "), value=float(stats[name]))
        yield CounterMetricFamily(f"{p}_steps", "engine steps", value=float(stats["num_steps"]))
        yield CounterMetricFamily(
            f"{p}_coalesced_outputs",
            "outputs merged while readers lagged",
            value=float(stats["num_merged_outputs"]),
        )
        finished = CounterMetricFamily(
            f"{p}_requests_finished", "finished requests by reason", labels=["reason"]
        )
        for reason, count in stats["finished"].items():
            finished.add_metric([reason], float(count))
        yield finished
        with self._metrics.lock:
            for name, hist in self._metrics.histograms().items():
                family = HistogramMetricFamily(f"{p}_{name}", name.replace("_", " "))
                snap = hist.snapshot()
                family.add_metric(
                    [],
                    [(k if k != "inf" else "+Inf", float(v)) for k, v in snap["buckets"].items()],
                    snap["sum"],
                )
                yield family


class EngineStats(dict[str, Any]):
    """The ``Engine.stats()`` dict, which a notebook shows as a short table (one row per
    number, the finish counts on one row, each histogram as its count and mean)."""

    def summary(self, state: str) -> str:
        """One line for ``repr(engine)``: ``state`` and the queues and KV blocks in use."""
        return (
            f"{state}, {self['num_running']} running, {self['num_waiting']} waiting, "
            f"KV blocks {self['kv_blocks_used']}/{self['kv_blocks_total']} used"
        )

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) pairs of the table."""
        rows = [(name, _cell(value)) for name, value in self.items() if not isinstance(value, dict)]
        finished = self.get("finished") or {}
        rows.append(("finished", ", ".join(f"{k} {v}" for k, v in finished.items()) or "none"))
        for name, snap in (self.get("histograms") or {}).items():
            if snap["count"]:
                unit = name.removesuffix("_seconds")
                rows.append((unit, f"{snap['count']} × mean {1e3 * snap['mean']:.2f} ms"))
        return rows

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        printer.text("\n".join(f"{name:<{width}}  {value}" for name, value in rows))

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td>{html.escape(name)}</td><td>{html.escape(value)}</td></tr>"
            for name, value in self.rows()
        )
        return f"<table><tr><th>Engine.stats()</th><th></th></tr>{cells}</table>"


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def engine_stats(
    core: EngineCoreStats | None,
    metrics: EngineMetrics,
    *,
    num_queued: int,
    num_coalesced_steps: int,
    grammars: CacheStats,
) -> EngineStats:
    """The ``Engine.stats()`` dict: queues, KV use, prefix-cache hit rate, histograms, and
    the grammar cache."""
    queried = core.num_prefix_queried_tokens if core else 0
    with metrics.lock:
        histograms = {name: h.snapshot() for name, h in metrics.histograms().items()}
        finished = dict(metrics.finished)
        merges = metrics.num_merged_outputs
    return EngineStats(
        {
            "num_running": core.num_running if core else 0,
            "num_waiting": core.num_waiting if core else 0,
            "num_queued": num_queued,
            "kv_blocks_used": (core.num_kv_blocks - core.num_free_blocks) if core else 0,
            "kv_blocks_total": core.num_kv_blocks if core else 0,
            "prefix_cache_hit_rate": (core.num_prefix_hit_tokens / queried)
            if core and queried
            else 0.0,
            "prefix_cache_hit_tokens": core.num_prefix_hit_tokens if core else 0,
            "prefix_cache_queried_tokens": queried,
            "num_steps": core.num_steps if core else 0,
            "num_merged_outputs": merges,
            "num_coalesced_steps": num_coalesced_steps,
            "finished": finished,
            "histograms": histograms,
            "grammar_cache_hits": grammars.hits,
            "grammar_cache_misses": grammars.misses,
            "grammar_compiles_abandoned": grammars.abandoned,
            "grammar_cache_entries": grammars.num_entries,
            "grammar_cache_bytes": grammars.num_bytes,
        }
    )
