"""Does the engine wait for the frontend? Step-period stretch under streaming HTTP load.

The echo runner stands in for a device with a 4.5 ms step that releases the GIL (a
Llama-3-8B decode step on an H100). This process serves ``inlinelm.api.create_app(engine)``
with uvicorn on 127.0.0.1; a load generator in another process opens B concurrent streaming
``/v1/chat/completions`` requests (plain sockets and one epoll loop, so the client stays cheap), each
``max_tokens`` tokens with ``ignore_eos``, and reads them to the end. Bounded in count and
time, loopback only, self-stopping.

Per B (1, 32, 128, 256 by default), for each engine-thread loop in the same run ("pipelined":
``async_scheduling=True``, the default, schedules step N+1 while the device runs step N;
"plain": waits for step N first):

* the engine's achieved step period (step start to next step start) over the steps where
  all B requests decode, its median and p99, and the stretch = median / 4.5 ms; the engine
  thread's CPU per step (scheduler + runner Python) and how far the period runs over 4.5 ms;
* the clients' TTFT and inter-token latency p50/p99 (per socket read: frames that arrive
  together count as 0 gaps after the first);
* coalescing: ``engine.stats()["num_merged_outputs"]`` (outputs merged into a waiting
  one in a collector) and coalesced steps (batches the output handler found queued);
* event-loop lag (``event_loop_lag_seconds``: step end → its batch handled), mean and p99.

The first B with over 1% of its outputs merged is where the frontend starts coalescing; an
"alone" column gives the same engine thread's stretch with no frontend at all. ``--switch-interval``
can repeat everything under other ``sys.setswitchinterval`` values.

``--stack`` names the serving stacks, event loop + uvicorn's HTTP parser: ``uvloop+httptools``
(what ``inlinelm serve`` runs, the default) and ``asyncio+h11`` (uvicorn's pure-Python
stack, what it ran before), or the mixed two. Several stacks run side by side in one
invocation, each wave set on a fresh engine and loop, alternated ``--repeats`` times, and a
comparison table gives the medians. Prints tables, writes ``--json PATH`` and
benchmarks/results/interference.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import itertools

from _common import (
    chat_messages,
    load_average,
    median,
    percentile,
    pyplot,
    save_plot,
    write_json,
)

STEP_S = 0.0045
STACKS = ("asyncio+h11", "asyncio+httptools", "uvloop+h11", "uvloop+httptools")
TARGET_STRETCH = 1.10
CONTENT = b'"delta":{"content":'
COALESCING_SHARE = 0.01
"""A wave coalesces when over this share of its outputs were merged in a collector."""


# -- load generator (another process) ------------------------------------------------------


@dataclass
class _Stream:
    """One client stream's progress: timestamps per socket read, frames counted per read."""

    sock: socket.socket
    sent: float
    gaps: list[float] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    frames: int = 0
    tail: bytes = b""
    status: bytes = b""
    done: bool = False


def _read(stream: _Stream, data: bytes, now: float) -> None:
    if not stream.status:
        stream.status = data.split(b"\r\n", 1)[0]
    window = stream.tail + data
    count = window.count(CONTENT)
    stream.tail = window[-(len(CONTENT) - 1) :]
    stream.done = stream.done or b"data: [DONE]" in window
    if count:
        stream.frames += count
        if stream.first is None:
            stream.first = now
        else:
            assert stream.last is not None
            stream.gaps.append(now - stream.last)
        stream.gaps.extend([0.0] * (count - 1))
        stream.last = now


def _load(port: int, batch: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """Open ``batch`` streaming requests and read them all with one epoll loop.

    Plain non-blocking sockets and ``select.epoll`` keep the client's CPU per frame small,
    since it shares this machine's cores with the server.
    """
    bodies = [
        json.dumps(
            {
                "model": "default",
                "messages": chat_messages(i),
                "stream": True,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
        ).encode()
        for i in range(batch)
    ]
    poller = select.epoll()
    streams: dict[int, _Stream] = {}
    start = time.perf_counter()
    deadline = start + timeout_s
    for body in bodies:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sent = time.perf_counter()
        sock.sendall(head + body)
        sock.setblocking(False)
        streams[sock.fileno()] = _Stream(sock, sent)
        poller.register(sock.fileno(), select.EPOLLIN)
    live = set(streams)
    try:
        while live:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            events = poller.poll(remaining)
            now = time.perf_counter()
            for fd, _ in events:
                stream = streams[fd]
                try:
                    data = stream.sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    _read(stream, data, now)
                if not data or stream.done:
                    poller.unregister(fd)
                    live.discard(fd)
    finally:
        poller.close()
        for stream in streams.values():
            stream.sock.close()
    return {
        "wall_s": time.perf_counter() - start,
        "streams": [
            {
                "status": st.status.decode(errors="replace"),
                "frames": st.frames,
                "ttft": None if st.first is None else st.first - st.sent,
                "gaps": st.gaps,
                "complete": st.done,
            }
            for st in streams.values()
        ],
    }


def client_process(port: int, batch: int, max_tokens: int, timeout_s: float, conn: Any) -> None:
    """Entry point of the load-generator process: run one wave, send the results back."""
    try:
        cpu = time.process_time()
        result = _load(port, batch, max_tokens, timeout_s)
        result["cpu_s"] = time.process_time() - cpu
        conn.send(result)
    except BaseException as e:
        conn.send({"error": repr(e)})
    finally:
        conn.close()


# -- server side (this process) ------------------------------------------------------------


class StepRecorder:
    """Wraps the engine's sink and the echo runner to time every step on the engine thread."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, int, float]] = []  # step_start, step_end, n, cpu
        self.recording = False

    def install(self) -> None:
        from inlinelm.runtime import engine_base as engine_module

        post = engine_module.post_outputs
        rows = self.rows

        def recording_post(dispatcher: Any, heartbeat: Any, batch: Any) -> None:
            if self.recording and batch.error is None:
                rows.append(
                    (batch.step_start, batch.step_end, len(batch.outputs), time.thread_time())
                )
            post(dispatcher, heartbeat, batch)

        engine_module.post_outputs = recording_post  # the Engine binds it when it loads

    def take(self) -> list[tuple[float, float, int, float]]:
        rows = list(self.rows)
        self.rows.clear()
        return rows


def step_stats(rows: list[tuple[float, float, int, float]], batch: int) -> dict[str, Any]:
    """Periods between consecutive step starts while all ``batch`` requests decode."""
    periods, cpus = [], []
    for a, b in itertools.pairwise(rows):
        if a[2] == batch and b[2] == batch:
            periods.append(b[0] - a[0])
            cpus.append(b[3] - a[3])
    if not periods:
        return {"steady_steps": 0}
    period = median(periods)
    cpu = median(cpus)
    return {
        "steady_steps": len(periods),
        "period_ms_p50": period * 1e3,
        "period_ms_p99": percentile(periods, 99) * 1e3,
        "stretch": period / STEP_S,
        "engine_cpu_ms_per_step": cpu * 1e3,
        "over_ms_per_step": (period - STEP_S) * 1e3,
    }


def hist_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Count, mean, and bucket-bound p50/p99 of the observations between two snapshots."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"count": 0}
    cumulative = [
        (float(k), after["buckets"][k] - before["buckets"].get(k, 0)) for k in after["buckets"]
    ]

    def quantile(q: float) -> float:
        for bound, running in cumulative:
            if running >= q * count:
                return bound
        return float("inf")

    return {
        "count": count,
        "mean_ms": (after["sum"] - before["sum"]) / count * 1e3,
        "p50_le_ms": quantile(0.5) * 1e3,
        "p99_le_ms": quantile(0.99) * 1e3,
    }


def engine_alone(args: argparse.Namespace, loop: str, batch: int, tokenizer: Any) -> dict[str, Any]:
    """The same echo engine thread with a sink that drops every batch: no event loop, no HTTP.

    Its step period is the floor the frontend can only add to (the scheduler's and the echo
    runner's own Python per step).
    """
    from inlinelm.gpu.echo_runner import EchoRunner
    from inlinelm.sampling_params import SamplingParams
    from inlinelm.sched.engine_core import EngineCore
    from inlinelm.sched.request import Request

    config = engine_config(args, loop)
    runner = EchoRunner(config, 1 << 14, tokenizer.eos_token_id)
    rows: list[tuple[float, float, int, float]] = []
    finished = threading.Event()
    left = [batch]

    def sink(out: Any) -> None:
        rows.append((out.step_start, out.step_end, len(out.outputs), time.thread_time()))
        left[0] -= sum(o.finish_reason is not None for o in out.outputs)
        if left[0] <= 0 or out.error is not None:
            finished.set()

    core = EngineCore(config.with_options(max_model_len=8192), runner, tokenizer.eos_token_id, sink)
    core.start()
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    for i in range(batch):
        ids = tokenizer.apply_chat_template(chat_messages(i), add_generation_prompt=True)
        core.add_request(Request(f"alone-{i}", list(ids), params, tokenizer.eos_token_id))
    finished.wait(args.timeout)
    core.shutdown()
    core.join(10)
    return step_stats(rows, batch)


def engine_config(args: argparse.Namespace, loop: str) -> Any:
    from inlinelm.config import EngineConfig

    return EngineConfig(
        model=args.model,
        runner="echo",
        async_scheduling=loop == "pipelined",
        echo_step_s=STEP_S,
        max_num_seqs=max(max(args.batch), 1),
        max_num_batched_tokens=8192,
    )


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    return sock


def run_stack(args: argparse.Namespace, stack: str, recorder: StepRecorder) -> list[dict[str, Any]]:
    """Every wave of every engine-thread loop, served by ``stack`` ("LOOP+HTTP")."""
    event_loop, http = stack.split("+")
    coro = serve_and_measure(args, http, recorder)
    if event_loop == "uvloop":
        import uvloop

        rows = uvloop.run(coro)
    else:
        rows = asyncio.run(coro)
    for row in rows:
        row["stack"] = stack
    return rows


async def serve_and_measure(
    args: argparse.Namespace, http: str, recorder: StepRecorder
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for loop in args.loop:
        rows.extend(await serve_and_measure_loop(args, loop, http, recorder))
    return rows


async def serve_and_measure_loop(
    args: argparse.Namespace, loop: str, http: str, recorder: StepRecorder
) -> list[dict[str, Any]]:
    """Every wave against one engine whose thread runs the ``loop`` ("pipelined" or "plain")."""
    import uvicorn

    from inlinelm.api import create_app
    from inlinelm.runtime.engine import Engine

    engine = Engine(engine_config(args, loop))
    await engine.start()
    alone = {}
    for batch in args.batch:
        alone[batch] = await asyncio.to_thread(engine_alone, args, loop, batch, engine.tokenizer)
        print(
            f"  {loop} B={batch:<4} engine alone: stretch {alone[batch].get('stretch', float('nan')):.3f}, "
            f"engine CPU {alone[batch].get('engine_cpu_ms_per_step', float('nan')):.2f} ms/step",
            flush=True,
        )
    app = create_app(engine)
    sock = free_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=5,
        http=http,
    )
    server = uvicorn.Server(config)
    server_task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if server_task.done():
            server_task.result()
        await asyncio.sleep(0.01)
    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    default_interval = sys.getswitchinterval()
    try:
        for interval in args.switch_interval:
            sys.setswitchinterval(interval)
            for batch in args.batch:
                before = engine.stats()
                parent_conn, child_conn = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=client_process,
                    args=(port, batch, args.max_tokens, args.timeout, child_conn),
                    daemon=True,
                )
                recorder.take()
                loop_cpu = time.thread_time()  # this is the event loop's thread
                proc.start()
                child_conn.close()
                recorder.recording = True
                # NOTE: wait in a thread, so the loop keeps serving while the clients run.
                client = await asyncio.to_thread(_receive, parent_conn, args.timeout + 30)
                recorder.recording = False
                loop_cpu = time.thread_time() - loop_cpu
                await asyncio.to_thread(proc.join, 10)
                if proc.is_alive():
                    proc.kill()
                await asyncio.sleep(0.2)  # the last aborts/finishes reach the stats
                after = engine.stats()
                rows.append(
                    summarize(batch, interval, args, client, recorder.take(), before, after)
                )
                rows[-1]["loop"] = loop
                rows[-1]["alone"] = alone[batch]
                rows[-1]["loop_cpu_s"] = loop_cpu
                rows[-1]["loop_cpu_us_per_frame"] = loop_cpu / max(rows[-1]["frames"], 1) * 1e6
                rows[-1]["loop_busy"] = loop_cpu / client["wall_s"]
                r = rows[-1]
                print(
                    f"  {type(asyncio.get_running_loop()).__module__} http={http} "
                    f"{loop} B={batch:<4} switch={interval * 1e3:g} ms: stretch {r.get('stretch', float('nan')):.3f}, "
                    f"merged {r['merged_outputs']}, complete {r['complete_streams']}/{batch}",
                    flush=True,
                )
    finally:
        sys.setswitchinterval(default_interval)
        server.should_exit = True
        await asyncio.wait_for(server_task, 30)
        await engine.aclose()
    return rows


def _receive(conn: Any, timeout: float) -> dict[str, Any]:
    if conn.poll(timeout):
        return conn.recv()  # type: ignore[no-any-return]
    return {"error": "the load generator sent nothing in time"}


def summarize(
    batch: int,
    interval: float,
    args: argparse.Namespace,
    client: dict[str, Any],
    steps: list[tuple[float, float, int, float]],
    before: dict[str, Any],
    after: dict[str, Any],
) -> dict[str, Any]:
    if "error" in client:
        raise RuntimeError(f"B={batch}: {client['error']}")
    streams = client["streams"]
    gaps = [g for s in streams for g in s["gaps"]]
    ttfts = [s["ttft"] for s in streams if s["ttft"] is not None]
    bad = {s["status"] for s in streams if "200" not in s["status"]}
    if bad:
        raise RuntimeError(f"B={batch}: responses {bad}")
    hists_b, hists_a = before["histograms"], after["histograms"]
    return {
        "batch": batch,
        "switch_interval_ms": interval * 1e3,
        **step_stats(steps, batch),
        "client_wall_s": client["wall_s"],
        "client_cpu_s": client["cpu_s"],
        "complete_streams": sum(s["complete"] for s in streams),
        "frames": sum(s["frames"] for s in streams),
        "expected_frames": batch * args.max_tokens,
        "ttft_ms_p50": median(ttfts) * 1e3,
        "ttft_ms_p99": percentile(ttfts, 99) * 1e3,
        "itl_ms_p50": median(gaps) * 1e3,
        "itl_ms_p99": percentile(gaps, 99) * 1e3,
        "itl_nonzero_ms_p50": median([g for g in gaps if g > 0]) * 1e3,
        "merged_outputs": after["num_merged_outputs"] - before["num_merged_outputs"],
        "coalesced_steps": after["num_coalesced_steps"] - before["num_coalesced_steps"],
        "loop_lag": hist_delta(
            hists_b["event_loop_lag_seconds"], hists_a["event_loop_lag_seconds"]
        ),
        "http_itl": hist_delta(hists_b["http_itl_seconds"], hists_a["http_itl_seconds"]),
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"interference: echo step {STEP_S * 1e3} ms, {report['max_tokens']} tokens per stream, "
        f"stacks {', '.join(report['stacks'])}, {report['repeats']} run(s) each, "
        f"load average {report['load_average']}"
    )
    cols = (
        f"{'stack':>17} {'loop':>9} {'B':>4} {'switch':>6} {'alone':>6} {'period p50':>10} {'p99':>6} {'stretch':>7} {'eng cpu':>7} "
        f"{'over':>6} {'ITL p50':>7} {'p99':>6} {'TTFT p50':>8} {'merged':>7} {'coal.st':>7} "
        f"{'lag mean':>8} {'lag p99<=':>9} {'loop µs':>8} {'busy':>5} {'done':>5}"
    )
    print(cols)
    print(
        f"{'':>17} {'':>9} {'':>4} {'ms':>6} {'strch':>6} {'ms':>10} {'ms':>6} {'':>7} {'ms':>7} {'ms':>6} {'ms':>7} {'ms':>6} "
        f"{'ms':>8} {'':>7} {'':>7} {'ms':>8} {'ms':>9} {'/frame':>8}"
    )
    for r in report["rows"]:
        lag = r["loop_lag"]
        print(
            f"{r['stack']:>17} {r['loop']:>9} {r['batch']:>4} {r['switch_interval_ms']:>6g} {r['alone'].get('stretch', float('nan')):>6.3f} "
            f"{r.get('period_ms_p50', float('nan')):>10.2f} "
            f"{r.get('period_ms_p99', float('nan')):>6.2f} {r.get('stretch', float('nan')):>7.3f} "
            f"{r.get('engine_cpu_ms_per_step', float('nan')):>7.2f} {r.get('over_ms_per_step', float('nan')):>6.2f} "
            f"{r['itl_ms_p50']:>7.2f} {r['itl_ms_p99']:>6.2f} {r['ttft_ms_p50']:>8.1f} "
            f"{r['merged_outputs']:>7} {r['coalesced_steps']:>7} {lag.get('mean_ms', 0):>8.2f} "
            f"{lag.get('p99_le_ms', 0):>9.1f} {r['loop_cpu_us_per_frame']:>8.1f} "
            f"{r['loop_busy']:>5.0%} {r['complete_streams']:>5}"
        )
    for key, first in report["coalescing_starts_at"].items():
        print(f"{key}: frontend starts coalescing at B = {first}")
    print(
        "loop = the engine thread's loop: pipelined schedules step N+1 while the device runs "
        "step N (async_scheduling=True, the default), plain waits for step N first; "
        "alone = stretch of the same engine thread with no frontend (sink drops batches); "
        "stretch = median step period / 4.5 ms; eng cpu = engine-thread CPU per step; over = "
        "period - 4.5 ms; ITL per client socket read; "
        "loop µs/frame = event-loop thread CPU per content frame sent, busy = its CPU / wall"
    )
    if len(report["stacks"]) > 1:
        print_stack_comparison(report)


STACK_METRICS = (
    ("lag mean ms", lambda r: r["loop_lag"].get("mean_ms", 0.0)),
    ("lag p99<= ms", lambda r: r["loop_lag"].get("p99_le_ms", 0.0)),
    ("stretch", lambda r: r.get("stretch", float("nan"))),
    ("ITL p50 ms", lambda r: r["itl_ms_p50"]),
    ("ITL p99 ms", lambda r: r["itl_ms_p99"]),
    ("TTFT p50 ms", lambda r: r["ttft_ms_p50"]),
    ("loop µs/frame", lambda r: r["loop_cpu_us_per_frame"]),
    ("busy", lambda r: r["loop_busy"]),
    ("merged", lambda r: r["merged_outputs"]),
)


def stack_comparison(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per engine loop, B and stack: the median of each metric over the alternated runs."""
    groups: dict[tuple[str, float, int, str], list[dict[str, Any]]] = {}
    for r in report["rows"]:
        key = (r["loop"], r["switch_interval_ms"], r["batch"], r["stack"])
        groups.setdefault(key, []).append(r)
    return [
        {
            "loop": loop,
            "switch_interval_ms": interval,
            "batch": batch,
            "stack": stack,
            "runs": len(rows),
            **{name: median([fn(r) for r in rows]) for name, fn in STACK_METRICS},
        }
        for (loop, interval, batch, stack), rows in groups.items()
    ]


def print_stack_comparison(report: dict[str, Any]) -> None:
    first, last = report["stacks"][0], report["stacks"][-1]
    print(
        f"\nserving stacks side by side, median of {report['repeats']} alternated runs "
        f"(ratio: {first} / {last})"
    )
    print(
        f"{'loop':>9} {'B':>4} {'stack':>17} "
        + " ".join(f"{name:>13}" for name, _ in STACK_METRICS)
    )
    rows = report["stack_comparison"]
    by_key = {(r["loop"], r["switch_interval_ms"], r["batch"], r["stack"]): r for r in rows}
    for r in rows:
        print(
            f"{r['loop']:>9} {r['batch']:>4} {r['stack']:>17} "
            + " ".join(f"{r[name]:>13.3g}" for name, _ in STACK_METRICS)
        )
        if r["stack"] == last:
            base = by_key.get((r["loop"], r["switch_interval_ms"], r["batch"], first))
            if base is not None:
                ratios = [base[n] / r[n] if r[n] else float("nan") for n, _ in STACK_METRICS]
                print(f"{'':>9} {'':>4} {'ratio':>17} " + " ".join(f"{x:>12.2f}x" for x in ratios))


def plot(report: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    by_series: dict[str, list[dict[str, Any]]] = {}
    for r in report["rows"]:
        if r["repeat"] == 0:
            by_series.setdefault(series_name(r), []).append(r)
    for name, rows in by_series.items():
        bs = [r["batch"] for r in rows]
        ax1.plot(bs, [r.get("stretch", float("nan")) for r in rows], "o-", label=name)
        ax2.plot(bs, [r["itl_ms_p50"] for r in rows], "o-", label=f"ITL p50, {name}")
        ax2.plot(bs, [r["itl_ms_p99"] for r in rows], "x--", label=f"ITL p99, {name}")
    seen = set()
    for rows in by_series.values():
        if rows[0]["loop"] in seen:
            continue
        seen.add(rows[0]["loop"])
        ax1.plot(
            [r["batch"] for r in rows],
            [r["alone"].get("stretch", float("nan")) for r in rows],
            "s:",
            label=f"{rows[0]['loop']}, engine alone (no frontend)",
        )
    ax1.axhline(TARGET_STRETCH, color="red", linestyle="--", label="target 1.10")
    ax1.set_xlabel("concurrent streams B")
    ax1.set_ylabel("step period / 4.5 ms")
    ax1.set_title("engine step stretch")
    ax1.legend(fontsize=8)
    ax2.axhline(STEP_S * 1e3, color="gray", linestyle=":", label="4.5 ms")
    ax2.set_xlabel("concurrent streams B")
    ax2.set_ylabel("ms")
    ax2.set_title("client inter-token latency")
    ax2.legend(fontsize=7)
    save_plot(fig, "interference.png")


def series_name(row: dict[str, Any]) -> str:
    return f"{row['stack']}, {row['loop']}, switch {row['switch_interval_ms']:g} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=60.0, help="per wave, seconds")
    parser.add_argument(
        "--switch-interval",
        type=float,
        nargs="+",
        default=[sys.getswitchinterval()],
        help="sys.setswitchinterval values (seconds) to run the waves under",
    )
    parser.add_argument(
        "--loop",
        nargs="+",
        default=["pipelined", "plain"],
        choices=["pipelined", "plain"],
        help="engine-thread loops to measure, side by side (async_scheduling on / off)",
    )
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--stack",
        nargs="+",
        default=["uvloop+httptools"],
        choices=STACKS,
        help="serving stacks (event loop + uvicorn's HTTP) to measure, side by side",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="alternated runs of every stack (medians)"
    )
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    logging.getLogger("inlinelm").setLevel(logging.WARNING)
    # NOTE: a lagging reader logs a warning per request; the merged count says the same.
    logging.getLogger("inlinelm.runtime.collector").setLevel(logging.ERROR)
    threading.current_thread().name = "event-loop"
    recorder = StepRecorder()
    recorder.install()
    all_rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for stack in args.stack:
            for row in run_stack(args, stack, recorder):
                row["repeat"] = repeat
                all_rows.append(row)
    coalescing: dict[str, Any] = {}
    by_series: dict[str, list[dict[str, Any]]] = {}
    for r in all_rows:
        if r["repeat"] == 0:
            by_series.setdefault(series_name(r), []).append(r)
    for name, rows in by_series.items():
        first = next(
            (
                r["batch"]
                for r in rows
                if r["merged_outputs"] > COALESCING_SHARE * r["batch"] * args.max_tokens
            ),
            None,
        )
        coalescing[name] = first
    report = {
        "stacks": args.stack,
        "repeats": args.repeats,
        "step_ms": STEP_S * 1e3,
        "max_tokens": args.max_tokens,
        "target_stretch": TARGET_STRETCH,
        "load_average": load_average(),
        "coalescing_starts_at": coalescing,
        "rows": all_rows,
    }
    report["stack_comparison"] = stack_comparison(report)
    print_table(report)
    write_json(args.json, report)
    if not args.no_plot:
        plot(report)


if __name__ == "__main__":
    main()
