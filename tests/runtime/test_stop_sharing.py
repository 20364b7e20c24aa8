"""A request's stop strings are prepared once and shared by its choices: with the caps
raised, a 20,000-character stop with n=8 streams exactly, its table built once for all
choices (each keeps only its matcher) and a few bytes per character."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from inlinelm.detok import StopStrings
from tests.helpers import bridges_of
from tests.runtime.helpers import assert_drained, echo_engine, echo_text, run

LONG = 20_000
TABLE_BYTES_PER_CHAR = 32  # the stop table's budget, see tests/detok/test_stop_scaling.py
STATE_BYTES = 64 * 1024  # eight choices' states, detokenizers, engine requests


def test_a_20000_char_stop_with_n_8_builds_one_small_table_and_streams_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builds: list[StopStrings] = []
    build = StopStrings.__init__

    def counted(self: StopStrings, stops: Any) -> None:
        build(self, stops)
        builds.append(self)

    monkeypatch.setattr(StopStrings, "__init__", counted)

    async def main() -> None:
        async with echo_engine(max_stop_string_chars=LONG, max_n=8) as engine:
            prompt = " ".join(f"word{i}" for i in range(150)) + " THE-END and after"
            full = echo_text(engine, prompt)
            # the answer follows the long stop all the way, so all of it is held back until
            # the short stop matches
            long_stop = (full + "§" * LONG)[:LONG]
            tracemalloc.start()
            try:
                stream = engine.stream(prompt, stop=[long_stop, "THE-END"], n=8, max_tokens=None)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert len(builds) == 1  # once per request, not per choice
            states = [s for b in bridges_of(engine) for s in b.processor.states.values()]
            assert len(states) == 8
            assert all(s.detokenizer.stop_strings is builds[0] for s in states)
            assert peak < TABLE_BYTES_PER_CHAR * LONG + STATE_BYTES
            texts: dict[int, list[str]] = {}
            ends: dict[int, tuple[str | None, str | int | None]] = {}
            async for out in stream:
                for choice in out.outputs:
                    texts.setdefault(choice.index, []).append(choice.text)
                    if choice.finish_reason is not None:
                        ends[choice.index] = (choice.finish_reason, choice.stop_reason)
            expected = full[: full.index("THE-END")]
            assert {i: "".join(t) for i, t in texts.items()} == {i: expected for i in range(8)}
            assert all(t[:-1] == [""] * (len(t) - 1) for t in texts.values())  # held back
            assert ends == {i: ("stop", "THE-END") for i in range(8)}
            await assert_drained(engine)

    run(main())
