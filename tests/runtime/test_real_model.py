"""The runtime on a real (tiny, random) model: streamed text is exactly the tokenizer's
one-shot decode of the output ids, for concurrent greedy and sampled requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from inlinelm import Engine, RequestStream, SamplingParams
from tests.runtime.helpers import assert_drained, run

PROMPTS = [
    "Hello, my name is",
    "The capital of France",
    "1 2 3 4",
    "Once upon a time 🦙",
    "日本語",
    "def main():",
]


def test_streamed_text_equals_the_one_shot_decode_for_concurrent_greedy_requests(
    tiny_model_dir: Path,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)

    async def read(stream: RequestStream) -> tuple[str, list[int], str | None]:
        text, ids, reason = "", [], None
        async for out in stream:
            text += out.text
            ids.extend(out.token_ids)
            reason = out.finish_reason
        return text, ids, reason

    async def main() -> None:
        async with Engine(model=str(tiny_model_dir), runner="model") as engine:
            results = await asyncio.gather(*(read(engine.stream(p, params)) for p in PROMPTS))
            tokenizer = engine.tokenizer
            for prompt, (text, ids, reason) in zip(PROMPTS, results, strict=True):
                assert ids, prompt
                assert text == tokenizer.decode(ids, skip_special_tokens=True), prompt
                assert reason in ("stop", "length")
                assert len(ids) <= 24
            # Sampled tokens wander over the whole vocabulary (byte pieces, rare merges):
            # the streamed text still equals the one-shot decode.
            sampled = await asyncio.gather(
                *(
                    read(engine.stream(p, params, temperature=1.0, seed=i, max_tokens=48))
                    for i, p in enumerate(PROMPTS)
                )
            )
            for text, ids, _ in sampled:
                assert text == tokenizer.decode(ids, skip_special_tokens=True)
            assert len({tuple(ids) for _, ids, _ in sampled}) == len(PROMPTS)
            await assert_drained(engine)

    run(main(), timeout=180)
