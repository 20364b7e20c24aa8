"""How long one huge prompt stalls everyone else's streams (DESIGN invariant 12).

Twenty requests stream from the echo runner (one token per 5 ms step) while one client
submits a 1 MB prompt, as a completion and as a chat message. The table shows the other
streams' largest gap between two outputs in a window around the submission, with the
prompt tokenized on the event loop (``max_inline_prompt_chars`` past 1 MB: the behaviour
before the fix) and on the engine's worker threads (the default), in the same run, plus the
same window with no big prompt at all as the floor. Each row is the median of ``--repeats``
runs. Ratios, not absolutes, are the result: these machines are noisy.

    python benchmarks/prompt_stall.py --json benchmarks/results/prompt_stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

from _common import load_average, median, write_json
from inlinelm import Engine, RequestError

NUM_STREAMS = 20
STEP_S = 0.005
BIG_CHARS = 1_000_000
WINDOW_S = 1.5


async def largest_gap(engine: Engine, submit_big: Any) -> float:
    """Start the streams, submit the big prompt (if any) once they flow, return the largest
    gap between two outputs of any stream over the window that follows."""
    streams = [
        engine.stream(f"bystander {i}", ignore_eos=True, max_tokens=4000)
        for i in range(NUM_STREAMS)
    ]
    flowing = asyncio.Event()
    gaps: list[float] = []
    window_end = float("inf")

    async def read(stream: Any) -> None:
        last = None
        async for _ in stream:
            now = time.perf_counter()
            if last is not None and flowing.is_set():
                gaps.append(now - last)
            last = now
            flowing.set()
            if now > window_end:
                break

    readers = [asyncio.create_task(read(s)) for s in streams]
    await flowing.wait()
    window_end = time.perf_counter() + WINDOW_S
    if submit_big is not None:
        await submit_big()
    await asyncio.gather(*readers)
    for stream in streams:
        await stream.aclose()
    return max(gaps)


def big_completion(engine: Engine) -> Any:
    async def submit() -> None:
        # NOTE: tokenized, then refused (past the context): in stream() when it runs inline
        with contextlib.suppress(RequestError):
            stream = engine.stream("word " * (BIG_CHARS // 5), max_tokens=1)
            await stream.submit()

    return submit


def big_chat(engine: Engine) -> Any:
    async def submit() -> None:
        with contextlib.suppress(RequestError):
            stream = engine.chat([{"role": "user", "content": "word " * (BIG_CHARS // 5)}])
            await stream.submit()

    return submit


async def measure(inline: bool, repeats: int) -> dict[str, float]:
    limit = BIG_CHARS * 2 if inline else None
    options: dict[str, Any] = {"runner": "echo", "echo_step_s": STEP_S}
    if limit is not None:
        options["max_inline_prompt_chars"] = limit
    result: dict[str, float] = {}
    async with Engine(**options) as engine:
        for name, make in (("none", None), ("completion", big_completion), ("chat", big_chat)):
            if name == "none" and inline:
                continue
            runs = [
                await largest_gap(engine, make(engine) if make else None) for _ in range(repeats)
            ]
            result[name] = median(runs) * 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    before = asyncio.run(measure(inline=True, repeats=args.repeats))
    after = asyncio.run(measure(inline=False, repeats=args.repeats))
    floor = after.pop("none")
    print(f"\nload average {load_average()}; {NUM_STREAMS} streams, {STEP_S * 1000:.0f} ms steps")
    print(f"other streams' largest gap (ms, median of {args.repeats}); no big prompt: {floor:.1f}")
    print(f"{'1 MB prompt as':>16} {'on the loop':>12} {'off the loop':>13} {'ratio':>7}")
    rows = {}
    for name in ("completion", "chat"):
        ratio = before[name] / after[name]
        rows[name] = {"on_loop_ms": before[name], "off_loop_ms": after[name], "ratio": ratio}
        print(f"{name:>16} {before[name]:>12.1f} {after[name]:>13.1f} {ratio:>6.1f}x")
    write_json(
        args.json,
        {
            "streams": NUM_STREAMS,
            "step_ms": STEP_S * 1000,
            "prompt_chars": BIG_CHARS,
            "floor_ms": floor,
            "rows": rows,
            "load_average": load_average(),
        },
    )


if __name__ == "__main__":
    main()
