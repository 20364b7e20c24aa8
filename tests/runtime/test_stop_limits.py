"""Stop strings against the engine's caps: more than ``max_stop_strings``, or one longer than
``max_stop_string_chars``, is a ``RequestError`` naming ``stop`` from ``stream()`` and
``chat()`` themselves, before anything is registered; at the caps the request is served."""

from __future__ import annotations

import pytest

from inlinelm import RequestError
from tests.runtime.helpers import assert_drained, echo_engine, echo_text, num_live_states, run

TOO_MANY = [f"stop{i}" for i in range(17)]
TOO_LONG = ["x" * 1025]
AT_CAPS = [f"{i:02d}" + "§" * 1022 for i in range(16)]  # 16 stops of 1024 characters


def test_stop_strings_past_the_default_caps_are_refused_by_stream_and_chat() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            for stop in (TOO_MANY, TOO_LONG):
                with pytest.raises(RequestError) as info:
                    engine.stream("hello", stop=stop)
                assert info.value.param == "stop"
                with pytest.raises(RequestError) as info:
                    engine.chat([{"role": "user", "content": "hi"}], stop=stop)
                assert info.value.param == "stop"
            assert num_live_states(engine) == (0, 0)

    run(main())


def test_stop_strings_exactly_at_the_caps_are_served() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            prompt = "sixteen stop strings of 1024 characters each"
            whole = await engine.stream(prompt, stop=AT_CAPS, max_tokens=None)
            assert whole.outputs[0].text == echo_text(engine, prompt)
            await assert_drained(engine)

    run(main())


def test_the_caps_are_engine_options() -> None:
    async def main() -> None:
        async with echo_engine(max_stop_strings=2, max_stop_string_chars=5) as engine:
            for stop in (["a", "b", "c"], ["abcdef"]):
                with pytest.raises(RequestError) as info:
                    engine.stream("hello", stop=stop)
                assert info.value.param == "stop"
            whole = await engine.stream("hello", stop=["abcde", "z"], max_tokens=None)
            assert whole.outputs[0].text == echo_text(engine, "hello")

    run(main())
