"""How long one huge input stalls everyone else's streams (DESIGN invariant 12).

Twenty requests stream from the echo runner (one token per 5 ms step) while one client
submits about 1 MB of input: a completion prompt, a chat message, a chat's tools, a
completion of many prompts each under the inline limit, and 250,000 token ids to
detokenize (as /detokenize and echo do). The table shows the other streams' largest gap
between two outputs in a window around the submission, with the work on the event loop
(the behaviour before each fix) and on the engine's worker threads (now), in the same run,
plus the same window with no big input at all as the floor. Each row is the median of ``--repeats``
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


def big_completion(engine: Engine, on_loop: bool) -> Any:
    async def submit() -> None:
        # NOTE: tokenized, then refused (past the context): in stream() when it runs inline
        with contextlib.suppress(RequestError):
            stream = engine.stream("word " * (BIG_CHARS // 5), max_tokens=1)
            await stream.submit()

    return submit


def big_chat(engine: Engine, on_loop: bool) -> Any:
    async def submit() -> None:
        with contextlib.suppress(RequestError):
            stream = engine.chat([{"role": "user", "content": "word " * (BIG_CHARS // 5)}])
            await stream.submit()

    return submit


def big_tools(engine: Engine, on_loop: bool) -> Any:
    """A short chat with 1 MB of tools, through a template that renders each tool as JSON
    (as Qwen2.5's and Llama 3.1's do). Before, only the messages' text counted, so this
    rendered on the loop."""
    messages = [{"role": "user", "content": "hi"}]
    description = "word " * (BIG_CHARS // 5 // NUM_TOOLS)
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": description}}
        for i in range(NUM_TOOLS)
    ]

    engine.tokenizer.chat_template = TOOLS_TEMPLATE

    async def submit() -> None:
        if on_loop:
            engine.tokenizer.encode(engine.render_chat(messages, tools))
            return
        with contextlib.suppress(RequestError):
            await engine.chat(messages, tools=tools, max_tokens=1).submit()

    return submit


def many_prompts(engine: Engine, on_loop: bool) -> Any:
    """A completion of many prompts, each just under the inline limit (1 MB in all): the
    router passes the body's size, so all go off the loop; before, each went inline."""
    limit = 16384  # the default max_inline_prompt_chars
    prompts = ["word " * ((limit - 5) // 5) for _ in range(BIG_CHARS // limit)]
    size = sum(map(len, prompts))

    async def submit() -> None:
        streams = [
            engine.stream(p, max_tokens=1, input_size=0 if on_loop else size) for p in prompts
        ]
        for stream in streams:
            await stream

    return submit


def big_detokenize(engine: Engine, on_loop: bool) -> Any:
    """/detokenize (and echo) of 250,000 token ids."""
    ids = (engine.tokenizer.encode(" ".join(WORDS)) * (250_000 // 10))[:250_000]

    async def submit() -> None:
        if on_loop:
            engine.tokenizer.decode(ids)
        else:
            await engine.detokenize(ids)

    return submit


CASES = {
    "completion": big_completion,
    "chat": big_chat,
    "tools": big_tools,
    "many prompts": many_prompts,
    "detokenize": big_detokenize,
}
NUM_TOOLS = 64
TOOLS_TEMPLATE = (
    "{% for tool in tools or [] %}{{ tool | tojson }}\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "ember"]


async def measure(on_loop: bool, repeats: int) -> dict[str, float]:
    """Each case's median largest gap (ms). ``on_loop``: the behaviour before the fix
    (prompts: ``max_inline_prompt_chars`` past 1 MB; the rest: the old calls, inline)."""
    options: dict[str, Any] = {"runner": "echo", "echo_step_s": STEP_S, "max_model_len": 1 << 20}
    if on_loop:
        options["max_inline_prompt_chars"] = BIG_CHARS * 2
    result: dict[str, float] = {}
    async with Engine(**options) as engine:
        for name, make in (("none", None), *CASES.items()):
            if name == "none" and on_loop:
                continue
            runs = [
                await largest_gap(engine, make(engine, on_loop) if make else None)
                for _ in range(repeats)
            ]
            result[name] = median(runs) * 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    before = asyncio.run(measure(on_loop=True, repeats=args.repeats))
    after = asyncio.run(measure(on_loop=False, repeats=args.repeats))
    floor = after.pop("none")
    print(f"\nload average {load_average()}; {NUM_STREAMS} streams, {STEP_S * 1000:.0f} ms steps")
    print(f"other streams' largest gap (ms, median of {args.repeats}); no big input: {floor:.1f}")
    print(f"{'1 MB input as':>16} {'on the loop':>12} {'off the loop':>13} {'ratio':>7}")
    rows = {}
    for name in CASES:
        ratio = before[name] / after[name]
        rows[name] = {"on_loop_ms": before[name], "off_loop_ms": after[name], "ratio": ratio}
        print(f"{name:>16} {before[name]:>12.1f} {after[name]:>13.1f} {ratio:>6.1f}x")
    write_json(
        args.json,
        {
            "streams": NUM_STREAMS,
            "step_ms": STEP_S * 1000,
            "input_chars": BIG_CHARS,
            "floor_ms": floor,
            "rows": rows,
            "load_average": load_average(),
        },
    )


if __name__ == "__main__":
    main()
