"""Event-loop cost per streamed token: output handler → OutputProcessor → collectors → SSE.

B streaming chat requests (B = 32, 128, 256 by default) are registered through the real
runtime pieces of an echo ``Engine`` (its ``LoopBridge``, ``OutputProcessor``, the
``RequestState``/``ParentRequest`` that the submitter's ``_make_states`` builds, with the real
incremental detokenizers and collectors) and read by one consumer task per request that runs
the router's SSE driver (``inlinelm.api.sse.event_stream``: ``chat.completion.chunk`` dicts
and their JSON) and turns each frame into SSE bytes as sse-starlette does (no socket).
A thread plays the engine thread: for T steps it builds one ``EngineCoreOutputs`` with one
token per request (ids cycled from a chat answer with markdown, code, emoji and CJK) and
hands it to the engine's own sink, ``post_outputs(dispatcher, heartbeat, batch)``; it posts
step k+1 once the loop has handled step k and every consumer has run, so no step coalesces.

Reported, in µs per token per request (median of ``--repeats`` runs):

* ``total``: CPU time of the event-loop thread (``time.thread_time``) over the run, divided
  by B x T: everything the loop does, including its wake-ups, and nothing it waits for.
* ``wall``: wall time from the first post to the last consumer's end, divided by B x T
  (adds the poster thread's hand-off once per step).
* per stage, from separate runs with timers wrapped around each piece (the timers add
  some cost, so the instrumented total is also given); ``loop_wakeups`` is what is left:
  the loop's selector and self-pipe, task switches, the handler's drain and slicing.
* floors measured in the same run: a bare ``DecodeStream.step``, a bare JSON encode of a
  chunk (the router's ``encode``, orjson; the stdlib encoder it replaced is shown beside it),
  one asyncio wake-up of a task waiting on an ``asyncio.Event``.

``--compare-encoders`` adds a side-by-side table: the same runs (no stop strings) with the
router's SSE frames made by stdlib ``json`` (the code before orjson, kept here) and by
orjson, alternated within each repeat, for the chat hot path (``TextFrame``: content chunks
from a template) and for generic frames (every chunk a dict through ``encode``, as
completions streams and streams with logprobs send them).

Every run checks that each stream's text (joined from its SSE frames) equals a one-shot
``tokenizer.decode`` of its ids. Without and with stop strings (which never match but
share prefixes with the text, so hold-back works). Prints tables, writes ``--json PATH``
and benchmarks/results/frontend.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sse_starlette.event import ensure_bytes
from tokenizers.decoders import DecodeStream

import inlinelm.api.sse as sse
from _common import (
    STOPS,
    answer_ids,
    chat_messages,
    load_average,
    median,
    pyplot,
    save_plot,
    write_json,
)
from inlinelm.api.formats import ChatFormat
from inlinelm.api.responses import ResponseHeader, TokenTexts, new_id
from inlinelm.runtime.bridge import post_outputs
from inlinelm.runtime.collector import RequestOutputCollector
from inlinelm.runtime.engine import Engine
from inlinelm.runtime.prompt_source import PromptSource
from inlinelm.runtime.stream import RequestStream, Submission
from inlinelm.runtime.submission import LazySubmission
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.output import EngineCoreOutput, EngineCoreOutputs
from inlinelm.sched.request import FinishReason

TARGET_US = 6.0
ENCODERS = ("stdlib", "orjson")
FRAME_PATHS = ("text", "generic")
STAGES = (
    "detokenize",
    "release_text",
    "output_and_put",
    "process_other",
    "stream_iter",
    "chunk_build",
    "json_encode",
    "sse_bytes",
    "loop_wakeups",
)
STAGE_HELP = {
    "detokenize": "detokenizer.update (DecodeStream step, stop-string search)",
    "release_text": "detokenizer.next_output_text (hold-back)",
    "output_and_put": "CompletionOutput + RequestOutput + collector.put",
    "process_other": "rest of process_outputs (state lookup, timing, finish)",
    "stream_iter": "consumer: RequestStream + event_stream generators, tally (output taken to next asked)",
    "chunk_build": "chat.completion.chunk dicts (_step_frames minus encode)",
    "json_encode": "api.sse.encode (orjson.dumps)",
    "sse_bytes": "sse-starlette ensure_bytes (data: ...\\n\\n)",
    "loop_wakeups": "the rest: selector, self-pipe, task switches, handler drain",
}


# -- timers for the instrumented runs ------------------------------------------------------


@dataclass
class Timers:
    """Seconds spent in each wrapped piece, summed over a run."""

    seconds: dict[str, float] = field(default_factory=dict)
    consumer_resumed: dict[int, float] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + value


def _timed(timers: Timers, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            timers.add(name, clock() - start)

    return wrapper


@contextlib.contextmanager
def instrumented(timers: Timers | None) -> Iterator[None]:
    """Wrap the module- and class-level pieces (collector, SSE driver) for one run."""
    if timers is None:
        yield
        return
    saved_get_nowait = RequestOutputCollector.get_nowait
    saved_step_frames, saved_encode = sse._step_frames, sse.encode
    clock = time.perf_counter

    def get_nowait(self: RequestOutputCollector) -> Any:
        # The consumer asks for its next output: what it did since it took the last one
        # is its body (the stream takes each output with get_nowait, after any wait).
        now = clock()
        resumed = timers.consumer_resumed.pop(id(self), None)
        if resumed is not None:
            timers.add("consumer_body", now - resumed)
        out = saved_get_nowait(self)
        if out is not None:
            timers.consumer_resumed[id(self)] = clock()
        return out

    RequestOutputCollector.get_nowait = get_nowait  # type: ignore[method-assign]
    sse._step_frames = _timed(timers, "step_frames", saved_step_frames)
    sse.encode = _timed(timers, "json_encode", saved_encode)
    try:
        yield
    finally:
        RequestOutputCollector.get_nowait = saved_get_nowait  # type: ignore[method-assign]
        sse._step_frames, sse.encode = saved_step_frames, saved_encode


def stages_from(timers: Timers, total_s: float, tokens: int) -> dict[str, float]:
    s = timers.seconds
    update, release = s.get("update", 0.0), s.get("release", 0.0)
    emit, process = s.get("emit", 0.0), s.get("process_outputs", 0.0)
    step_frames, encode = s.get("step_frames", 0.0), s.get("json_encode", 0.0)
    sse_bytes, body = s.get("sse_bytes", 0.0), s.get("consumer_body", 0.0)
    parts = {
        "detokenize": update,
        "release_text": release,
        "output_and_put": emit - release,
        "process_other": process - update - emit,
        "stream_iter": body - step_frames - sse_bytes,
        "chunk_build": step_frames - encode,
        "json_encode": encode,
        "sse_bytes": sse_bytes,
    }
    parts["loop_wakeups"] = total_s - sum(parts.values())
    return {k: v / tokens * 1e6 for k, v in parts.items()}


# -- the stdlib JSON encoder the router used before orjson (for --compare-encoders) ----------

_STDLIB_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def stdlib_encode(payload: dict[str, Any]) -> bytes:
    """``api.sse.encode`` as it was: the same bytes, but for floats under 1e-4."""
    return _STDLIB_ENCODER.encode(payload).encode()


def stdlib_render(self: sse.TextFrame, index: int, text: str, reason: str | None) -> bytes:
    """``TextFrame.render`` as it was (stdlib string escaping, an f-string, one encode)."""
    finish = "null" if reason is None else encode_basestring(reason)
    body = (
        f'{index},"delta":{{"content":{encode_basestring(text)}}},'
        f'"logprobs":null,"finish_reason":{finish}}}'
    )
    return self.head + body.encode() + self.tail


@contextlib.contextmanager
def json_encoder(name: str) -> Iterator[None]:
    """Make the router's SSE frames with ``name``'s JSON encoder for one run."""
    if name == "orjson":
        yield
        return
    saved_encode, saved_render = sse.encode, sse.TextFrame.render
    sse.encode = stdlib_encode
    sse.TextFrame.render = stdlib_render  # type: ignore[method-assign]
    try:
        yield
    finally:
        sse.encode = saved_encode
        sse.TextFrame.render = saved_render  # type: ignore[method-assign]


# -- one run -------------------------------------------------------------------------------


@dataclass
class Setup:
    engine: Engine
    loaded: Any
    bridge: Any
    tokenizer: Any
    prompts: list[list[int]]
    ids: list[list[int]]
    texts: TokenTexts
    done: threading.Event
    run_index: int = 0


class _NeverSubmitted:
    """A stream's pending submission that is never used: the benchmark registers its
    requests itself."""

    async def submit(self) -> Any:
        raise AssertionError("the benchmark registers its requests itself")


async def run_once(
    setup: Setup,
    batch: int,
    steps: int,
    *,
    stop: bool,
    timers: Timers | None,
    text_frames: bool = True,
) -> dict[str, float]:
    """One run: register ``batch`` requests, post ``steps`` steps, return timings (seconds).

    Chat content chunks come from the router's ``TextFrame`` template, or with
    ``text_frames=False`` as dicts through ``encode`` (completions, logprobs).
    """
    engine, loaded, bridge = setup.engine, setup.loaded, setup.bridge
    setup.run_index += 1
    params = SamplingParams(max_tokens=steps, stop=list(STOPS) if stop else [])
    rids, streams, frames = [], [], []
    for i in range(batch):
        rid = f"bench{setup.run_index}-{i}"
        prompt = setup.prompts[i % len(setup.prompts)]
        source = PromptSource.of_prompt(prompt, False, len(prompt))
        pending = LazySubmission(engine._submitter, source, params, rid, time.perf_counter())
        parent, children = engine._submitter._make_states(loaded, pending, prompt, params, None)
        bridge.processor.add(parent, children)
        if timers is not None:
            for child in children:
                d = child.detokenizer
                d.update = _timed(timers, "update", d.update)
                d.next_output_text = _timed(timers, "release", d.next_output_text)
        stream = RequestStream(rid, _NeverSubmitted(), delta=True)
        stream._attach(Submission(parent, bridge))
        rids.append(parent.child_ids[0])
        streams.append(stream)
        frames.append([])
    # The engine's batches, built before the clock starts (the engine builds them with the GIL
    # released between steps); step k+1 is posted once the loop has handled step k.
    ids = setup.ids
    batches = [
        [
            EngineCoreOutput(
                rids[i],
                [ids[i][k]],
                FinishReason.LENGTH if k == steps - 1 else None,
            )
            for i in range(batch)
        ]
        for k in range(steps)
    ]
    sink = functools.partial(post_outputs, engine._dispatcher, engine._heartbeat)
    done = setup.done
    done.clear()
    tally_metrics = engine.metrics

    async def consume(index: int) -> None:
        header = ResponseHeader(new_id("chatcmpl"), "default")
        plan = sse.StreamPlan(
            header,
            ChatFormat(setup.texts, False),
            1,
            tally_metrics,
            sse.StreamTally(time.perf_counter()),
            lambda tally: None,
            # the router's own hot path for chat content chunks without logprobs
            sse.TextFrame.for_chat(header, "chat.completion.chunk") if text_frames else None,
        )
        out = frames[index]
        if timers is None:
            async for data in sse.event_stream([streams[index]], plan):
                out.append(ensure_bytes(data, "\n"))
        else:
            clock = time.perf_counter
            async for data in sse.event_stream([streams[index]], plan):
                start = clock()
                out.append(ensure_bytes(data, "\n"))
                timers.add("sse_bytes", clock() - start)

    def post_all() -> None:
        for k, outputs in enumerate(batches):
            start = time.perf_counter()
            sink(
                EngineCoreOutputs(
                    outputs,
                    step_index=k,
                    step_start=start,
                    step_end=time.perf_counter(),
                )
            )
            done.wait()
            done.clear()

    processor = bridge.processor
    saved_process, saved_emit = processor.process_outputs, processor._emit
    if timers is not None:
        processor.process_outputs = _timed(timers, "process_outputs", saved_process)
        processor._emit = _timed(timers, "emit", saved_emit)
    gc.collect()
    try:
        with instrumented(timers):
            tasks = [asyncio.ensure_future(consume(i)) for i in range(batch)]
            for _ in range(3):  # every consumer sends its opening chunk and waits
                await asyncio.sleep(0)
            poster = threading.Thread(target=post_all, name="fake-engine")
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            poster.start()
            await asyncio.gather(*tasks)
            cpu1, wall1 = time.thread_time(), time.perf_counter()
            poster.join()
    finally:
        processor.process_outputs, processor._emit = saved_process, saved_emit
    check_texts(setup, frames, batch, steps)
    return {"cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0}


def check_texts(setup: Setup, frames: list[list[bytes]], batch: int, steps: int) -> None:
    """Each stream's text, joined from its SSE frames, must equal a one-shot decode."""
    for i in range(batch):
        text, finish = [], None
        for frame in frames[i]:
            data = frame.decode("utf-8").removeprefix("data: ").rstrip("\n")
            if data == "[DONE]":
                continue
            choice = json.loads(data)["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
        expected = setup.tokenizer.decode(setup.ids[i][:steps], skip_special_tokens=True)
        got = "".join(text)
        assert got == expected, f"stream {i}: text differs from decode(ids)\n{got!r}\n{expected!r}"
        assert finish == "length", f"stream {i}: finish_reason {finish!r}"
        assert frames[i][-1] == b"data: [DONE]\n\n", f"stream {i}: no [DONE]"


# -- floors --------------------------------------------------------------------------------


def floor_decode_stream(setup: Setup, batch: int, steps: int) -> float:
    """µs per bare ``DecodeStream.step``, primed like the fast detokenizer."""
    backend = setup.tokenizer.backend_tokenizer
    streams = [
        DecodeStream(ids=setup.prompts[i % len(setup.prompts)][-4:], skip_special_tokens=True)
        for i in range(batch)
    ]
    ids = setup.ids
    start = time.thread_time()
    for k in range(steps):
        for i, stream in enumerate(streams):
            stream.step(backend, ids[i][k])
    return (time.thread_time() - start) / (batch * steps) * 1e6


def floor_json(setup: Setup, batch: int, steps: int, *, encoder: str = "orjson") -> float:
    """µs per bare JSON encode of one ``chat.completion.chunk``, to UTF-8 bytes.

    ``orjson`` is the router's own ``encode``; ``stdlib`` the prepared ``json.JSONEncoder``
    it replaced (the same bytes for these chunks).
    """
    header = ResponseHeader(new_id("chatcmpl"), "default")
    fmt = ChatFormat(setup.texts, False)
    pieces = [setup.tokenizer.decode([t]) for t in setup.ids[0][:steps]]
    chunks = [header.chunk(fmt.chunk_object, [fmt.delta(0, p or " ", None)]) for p in pieces]
    encode = sse.encode if encoder == "orjson" else stdlib_encode
    assert encode(chunks[0]) == sse.encode(chunks[0])
    rounds = batch
    start = time.thread_time()
    for _ in range(rounds):
        for chunk in chunks:
            encode(chunk)
    return (time.thread_time() - start) / (rounds * len(chunks)) * 1e6


async def floor_wakeup(batch: int, steps: int) -> float:
    """µs per wake-up of a task waiting on an ``asyncio.Event`` (set, switch in, wait again)."""
    events = [asyncio.Event() for _ in range(batch)]

    async def waiter(event: asyncio.Event) -> None:
        while True:
            await event.wait()
            event.clear()

    tasks = [asyncio.ensure_future(waiter(e)) for e in events]
    await asyncio.sleep(0)
    start = time.thread_time()
    for _ in range(steps):
        for event in events:
            event.set()
        await asyncio.sleep(0)
    elapsed = time.thread_time() - start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return elapsed / (batch * steps) * 1e6


# -- driver --------------------------------------------------------------------------------


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(model=args.model, runner="echo")
    await engine.start()
    try:
        loaded = engine._handle.loaded
        assert loaded is not None
        loop = asyncio.get_running_loop()
        bridge = engine._submitter._loop_bridge(loop)
        tokenizer = engine.tokenizer
        prompts = [
            tokenizer.encode(engine.render_chat(chat_messages(i)), add_special_tokens=False)
            for i in range(16)
        ]
        setup = Setup(
            engine,
            loaded,
            bridge,
            tokenizer,
            prompts,
            answer_ids(tokenizer, max(args.batch), args.steps),
            TokenTexts(tokenizer),
            threading.Event(),
        )
        done = setup.done
        saved_handle = bridge._handle

        async def handle(batch: EngineCoreOutputs) -> None:
            await saved_handle(batch)
            loop.call_soon(done.set)  # after the consumers this step woke

        bridge._handle = handle
        steps = args.steps
        await run_once(setup, 8, 16, stop=True, timers=None)  # warm-up
        raw: dict[tuple[int, bool], dict[str, list[Any]]] = {}
        for _ in range(args.repeats):
            for b in args.batch:
                for stop in (False, True):
                    r = raw.setdefault((b, stop), {"cpu": [], "wall": [], "stages": []})
                    t = await run_once(setup, b, steps, stop=stop, timers=None)
                    r["cpu"].append(t["cpu_s"] / (b * steps) * 1e6)
                    r["wall"].append(t["wall_s"] / (b * steps) * 1e6)
        for _ in range(args.instrumented_repeats):
            for b in args.batch:
                for stop in (False, True):
                    timers = Timers()
                    t = await run_once(setup, b, steps, stop=stop, timers=timers)
                    raw[(b, stop)]["stages"].append(
                        {
                            "instrumented_total": t["cpu_s"] / (b * steps) * 1e6,
                            **stages_from(timers, t["cpu_s"], b * steps),
                        }
                    )
        floors_runs: dict[str, list[float]] = {"decode_stream": [], "json_encode": [], "wakeup": []}
        stdlib_floor: list[float] = []
        fb = max(args.batch)
        for _ in range(args.repeats):
            floors_runs["decode_stream"].append(floor_decode_stream(setup, fb, steps))
            floors_runs["json_encode"].append(floor_json(setup, fb, steps))
            floors_runs["wakeup"].append(await floor_wakeup(fb, steps))
            stdlib_floor.append(floor_json(setup, fb, steps, encoder="stdlib"))
        comparison = await compare_encoders(setup, args) if args.compare_encoders else None
        stats = engine.stats()
    finally:
        await engine.aclose()

    floors = {f"{k}_us": median(v) for k, v in floors_runs.items()}
    floors["sum_us"] = sum(floors.values())
    floors["stdlib_encode_us"] = median(stdlib_floor)  # not a floor: the encoder orjson replaced
    results: dict[str, Any] = {}
    for b in args.batch:
        entry: dict[str, Any] = {}
        for stop in (False, True):
            r = raw[(b, stop)]
            stages = {
                key: median([s[key] for s in r["stages"]])
                for key in ("instrumented_total", *STAGES)
            }
            values = {
                "total_us_per_token": median(r["cpu"]),
                "wall_us_per_token": median(r["wall"]),
                "total_runs_us": [round(v, 3) for v in r["cpu"]],
                "instrumented_total_us": stages.pop("instrumented_total"),
                **{f"{k}_us": v for k, v in stages.items()},
            }
            if stop:
                entry["with_stop"] = values
            else:
                entry.update(values)
        results[str(b)] = entry
    return {
        "steps": steps,
        "repeats": args.repeats,
        "target_us_per_token": TARGET_US,
        "load_average": load_average(),
        "floors": floors,
        "stages": STAGE_HELP,
        "num_merged_outputs": stats["num_merged_outputs"],
        "num_coalesced_steps": stats["num_coalesced_steps"],
        "results": results,
        "encoder_comparison": comparison,
    }


async def compare_encoders(setup: Setup, args: argparse.Namespace) -> list[dict[str, Any]]:
    """µs/token with stdlib JSON and with orjson, alternated run by run (no stop strings)."""
    runs: dict[tuple[int, str, str], list[float]] = {}
    for _ in range(args.repeats):
        for b in args.batch:
            for path in FRAME_PATHS:
                for encoder in ENCODERS:
                    with json_encoder(encoder):
                        t = await run_once(
                            setup,
                            b,
                            args.steps,
                            stop=False,
                            timers=None,
                            text_frames=path == "text",
                        )
                    runs.setdefault((b, path, encoder), []).append(
                        t["cpu_s"] / (b * args.steps) * 1e6
                    )
    rows = []
    for b in args.batch:
        for path in FRAME_PATHS:
            stdlib, fast = runs[(b, path, "stdlib")], runs[(b, path, "orjson")]
            rows.append(
                {
                    "batch": b,
                    "frames": path,
                    "stdlib_us_per_token": median(stdlib),
                    "orjson_us_per_token": median(fast),
                    "ratio": median(stdlib) / median(fast),
                    "stdlib_runs_us": [round(v, 3) for v in stdlib],
                    "orjson_runs_us": [round(v, 3) for v in fast],
                }
            )
    return rows


def print_tables(report: dict[str, Any]) -> None:
    results, floors = report["results"], report["floors"]
    print(
        f"frontend: {report['steps']} steps, one token per request per step, median of "
        f"{report['repeats']} runs; load average {report['load_average']}"
    )
    print(
        f"floors: DecodeStream.step {floors['decode_stream_us']:.2f} µs, chunk JSON encode "
        f"{floors['json_encode_us']:.2f} µs, asyncio wake-up {floors['wakeup_us']:.2f} µs, "
        f"sum {floors['sum_us']:.2f} µs (the same chunk with stdlib json: "
        f"{floors['stdlib_encode_us']:.2f} µs)"
    )
    print(
        f"coalescing during the runs (must be 0): merged outputs {report['num_merged_outputs']}, "
        f"coalesced steps {report['num_coalesced_steps']}"
    )
    head = f"{'B':>4} {'stop':>4} {'total µs/tok':>12} {'wall µs/tok':>11} {'vs floors':>9} {'target':>7}"
    print(head)
    for b, entry in results.items():
        for stop, values in (("no", entry), ("yes", entry["with_stop"])):
            total = values["total_us_per_token"]
            verdict = "met" if total <= TARGET_US else f"+{total / TARGET_US - 1:.0%}"
            print(
                f"{b:>4} {stop:>4} {total:>12.2f} {values['wall_us_per_token']:>11.2f} "
                f"{total / floors['sum_us']:>8.2f}x {verdict:>7}"
            )
    print("\nper stage, µs per token (instrumented runs; timers add cost, see 'instr. total')")
    cols = ["instr. total", *STAGES]
    print(f"{'B':>4} {'stop':>4} " + " ".join(f"{c[:12]:>12}" for c in cols))
    for b, entry in results.items():
        for stop, values in (("no", entry), ("yes", entry["with_stop"])):
            row = [values["instrumented_total_us"], *(values[f"{s}_us"] for s in STAGES)]
            print(f"{b:>4} {stop:>4} " + " ".join(f"{v:>12.2f}" for v in row))
    for stage, text in STAGE_HELP.items():
        print(f"  {stage}: {text}")
    if report["encoder_comparison"]:
        print_encoder_comparison(report)


def print_encoder_comparison(report: dict[str, Any]) -> None:
    print(
        f"\nSSE frames' JSON: stdlib json vs orjson, event-loop CPU µs per token, median of "
        f"{report['repeats']} alternated runs, no stop strings"
    )
    print(f"{'B':>4} {'frames':>8} {'stdlib':>8} {'orjson':>8} {'stdlib/orjson':>13}")
    for r in report["encoder_comparison"]:
        print(
            f"{r['batch']:>4} {r['frames']:>8} {r['stdlib_us_per_token']:>8.2f} "
            f"{r['orjson_us_per_token']:>8.2f} {r['ratio']:>12.2f}x"
        )
    print(
        "  frames: text = chat content chunks from the router's template (TextFrame), the "
        "default chat path; generic = every chunk a dict through encode (completions, logprobs)"
    )


def plot(report: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    results = report["results"]
    fig, ax = plt.subplots(figsize=(9, 5))
    labels, bottoms = [], []
    bars: dict[str, list[float]] = {s: [] for s in STAGES}
    totals = []
    for b, entry in results.items():
        for stop, values in (("", entry), (" +stop", entry["with_stop"])):
            labels.append(f"B={b}{stop}")
            parts = {s: max(values[f"{s}_us"], 0.0) for s in STAGES}
            measured = sum(parts.values())
            scale = values["total_us_per_token"] / measured if measured else 1.0
            for s in STAGES:  # scaled so the bar's height is the clean total
                bars[s].append(parts[s] * scale)
            totals.append(values["total_us_per_token"])
    bottoms = [0.0] * len(labels)
    for s in STAGES:
        ax.bar(labels, bars[s], bottom=bottoms, label=s)
        bottoms = [a + b for a, b in zip(bottoms, bars[s], strict=True)]
    ax.axhline(TARGET_US, color="red", linestyle="--", label=f"target {TARGET_US} µs")
    ax.axhline(report["floors"]["sum_us"], color="black", linestyle=":", label="sum of floors")
    ax.set_ylabel("event-loop CPU µs per token per request")
    ax.set_title("inlinelm frontend cost per streamed token (stages scaled to the clean total)")
    ax.legend(fontsize=7, ncol=2)
    plt.setp(ax.get_xticklabels(), rotation=20)
    save_plot(fig, "frontend.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--instrumented-repeats", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--compare-encoders",
        action="store_true",
        help="also run stdlib json and orjson side by side (the SSE frames' JSON)",
    )
    args = parser.parse_args()
    report = asyncio.run(bench(args))
    print_tables(report)
    write_json(args.json, report)
    if not args.no_plot:
        plot(report)


if __name__ == "__main__":
    main()
