"""Answer 100 questions in one synchronous call: continuous batching, with a progress bar.

    python examples/batch.py

No ``async`` needed: ``Engine.generate_chat`` blocks until every answer is in (it also works
inside a running event loop, such as a Jupyter cell). ``INLINELM_EXAMPLE_RUNNER=echo``
swaps the model for a scripted echo (tokenizer only).
"""

from __future__ import annotations

import os
import time

from inlinelm import Engine, SamplingParams

# fmt: off
WORDS = [
    "river", "stone", "lantern", "harvest", "whisper", "anchor", "meadow", "thunder", "compass",
    "orchard", "ember", "glacier", "harbor", "velvet", "falcon", "canyon", "maple", "summit",
    "quill", "tide", "beacon", "willow", "copper", "prairie", "orbit",
]
# fmt: on
TASKS = [
    "Give one synonym for '{}'.",
    "Translate '{}' into French.",
    "Use '{}' in a short sentence.",
    "Is '{}' a noun, a verb or an adjective?",
]


def main() -> None:
    questions = [task.format(word) for word in WORDS for task in TASKS]
    engine = Engine(model="default", runner=os.environ.get("INLINELM_EXAMPLE_RUNNER", "model"))
    try:
        # One conversation per question: the chat template makes the prompt the instruct
        # model expects. A tqdm progress bar shows on a terminal.
        conversations = [[{"role": "user", "content": q}] for q in questions]
        params = SamplingParams(temperature=0.0, max_tokens=32)
        start = time.perf_counter()
        outputs = engine.generate_chat(conversations, params)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    for question, out in list(zip(questions, outputs, strict=True))[:4]:
        print(f"Q: {question}\nA: {out.text.strip()}\n")
    num_tokens = sum(len(out.token_ids) for out in outputs)
    print(f"{len(outputs)} answers, {num_tokens} tokens in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
