"""Admission and validation (invariant 10): queue limits refuse at submit time, a queue wait
limit fails the request, bad lengths and bad sampling values raise ``RequestError`` naming
the field from ``stream()`` itself, before anything is registered or queued."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inlinelm import (
    ConfigError,
    Engine,
    QueueFullError,
    QueueTimeoutError,
    RequestError,
    RequestFailedError,
    SamplingParams,
)
from inlinelm.sched.request import Request
from tests.helpers import core_of, loaded_of
from tests.runtime.helpers import (
    WAIT_S,
    RunnerGate,
    assert_drained,
    echo_engine,
    echo_text,
    num_live_states,
    run,
    wait_event,
)


class AddSpy:
    """Records the requests handed to the engine thread."""

    def __init__(self, engine: Engine) -> None:
        core = core_of(engine)
        self._add = core.add_request
        self.requests: list[Request] = []
        core.add_request = self  # type: ignore[method-assign]

    def __call__(self, request: Request) -> None:
        self.requests.append(request)
        self._add(request)


class TokenizeSpy:
    """Counts prompt tokenizations (admission by count must refuse before tokenizing)."""

    def __init__(self, engine: Engine) -> None:
        self.admission = loaded_of(engine).admission
        self._tokenize = self.admission.tokenize
        self.calls = 0
        loaded_of(engine).admission = self

    def tokenize(self, *args: Any, **kwargs: Any) -> list[int]:
        self.calls += 1
        ids: list[int] = self._tokenize(*args, **kwargs)
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.admission, name)


def test_max_queued_requests_refuses_at_submit_before_tokenizing() -> None:
    async def main() -> None:
        async with echo_engine(max_queued_requests=3) as engine:
            spy = TokenizeSpy(engine)
            with RunnerGate(engine) as gate:
                gate.close()
                streams = [engine.stream(f"queued {i}", max_tokens=None) for i in range(3)]
                await wait_event(gate.entered)
                assert engine.stats()["num_queued"] == 3
                with pytest.raises(QueueFullError) as info:
                    engine.stream("one too many")
                assert isinstance(info.value, RequestError)
                assert info.value.retry_after_s > 0
                assert spy.calls == 3, "the refused prompt was tokenized"
                assert num_live_states(engine) == (3, 3)
            outs = await asyncio.gather(*streams)
            assert [o.text for o in outs] == [echo_text(engine, f"queued {i}") for i in range(3)]
            # Requests leave the queue when their first token arrives: room again.
            assert engine.stats()["num_queued"] == 0
            again = await engine.stream("room again", max_tokens=None)
            assert again.text == echo_text(engine, "room again")
            await assert_drained(engine)

    run(main())


def test_max_queued_tokens_refuses_a_prompt_that_would_overflow_the_queue() -> None:
    async def main() -> None:
        async with echo_engine(max_queued_tokens=20) as engine:
            ids = list(range(100, 112))  # 12 tokens
            with RunnerGate(engine) as gate:
                gate.close()
                first = engine.stream(ids, max_tokens=None)
                await wait_event(gate.entered)
                with pytest.raises(QueueFullError):
                    engine.stream(list(range(200, 212)))  # 12 + 12 > 20
                small = engine.stream(list(range(300, 308)), max_tokens=None)  # 12 + 8 <= 20
                with pytest.raises(QueueFullError):
                    engine.stream([5])  # 20 + 1 > 20
                assert num_live_states(engine) == (2, 2)
            a, b = await asyncio.gather(first, small)
            assert a.token_ids[:-1] == ids
            assert b.token_ids[:-1] == list(range(300, 308))
            await assert_drained(engine)

    run(main())


def test_a_request_queued_longer_than_max_queue_wait_gets_queue_timeout_error() -> None:
    async def main() -> None:
        async with echo_engine(max_queue_wait_s=0.2) as engine:
            with RunnerGate(engine) as gate:
                gate.close()
                stream = engine.stream("waits too long", max_tokens=None)
                await wait_event(gate.entered)
                with pytest.raises(QueueTimeoutError) as info:
                    await asyncio.wait_for(stream, WAIT_S)
                assert isinstance(info.value, RequestFailedError)
                assert num_live_states(engine) == (0, 0)
                assert engine.stats()["num_queued"] == 0
            await assert_drained(engine)

    run(main())


def test_a_request_stuck_behind_a_full_batch_times_out_and_the_running_one_finishes() -> None:
    async def main() -> None:
        # One sequence at a time: the second request waits in the scheduler's queue.
        async with echo_engine(max_num_seqs=1, echo_step_s=0.002, max_queue_wait_s=0.2) as engine:
            running = engine.stream("holds the only slot", ignore_eos=True, max_tokens=400)
            reader = asyncio.create_task(_result(running))
            waiting = engine.stream("waits for the slot", max_tokens=None)
            with pytest.raises(QueueTimeoutError):
                await asyncio.wait_for(waiting, WAIT_S)
            out = await asyncio.wait_for(reader, WAIT_S)
            assert out.finish_reason == "length"
            assert len(out.token_ids) == 400
            await assert_drained(engine)

    run(main())


async def _result(stream: Any) -> Any:
    return await stream


def test_the_queue_wait_limit_does_not_touch_a_request_that_started() -> None:
    async def main() -> None:
        # 60 steps of 20 ms: the request runs well past max_queue_wait_s once started, and
        # its first step ends ~0.5 s before the limit even when the machine is loaded.
        async with echo_engine(max_queue_wait_s=0.5, echo_step_s=0.02) as engine:
            out = await engine.stream("started in time", ignore_eos=True, max_tokens=60)
            assert out.finish_reason == "length"
            assert len(out.token_ids) == 60
            assert out.metrics.e2e is not None and out.metrics.e2e > 0.5

    run(main())


def test_lengths_that_cannot_fit_raise_request_error_before_anything_is_queued() -> None:
    async def main() -> None:
        async with echo_engine(max_model_len=64) as engine:
            spy = AddSpy(engine)
            with pytest.raises(RequestError) as info:
                engine.stream(list(range(10, 74)))  # 64 tokens: no room for one more
            assert info.value.param == "prompt"
            assert "64" in str(info.value)
            with pytest.raises(RequestError) as info:
                engine.stream(list(range(10, 20)), max_tokens=55)  # 10 + 55 > 64
            assert info.value.param == "max_tokens"
            with pytest.raises(RequestError) as info:
                engine.stream("")
            assert info.value.param == "prompt"
            with pytest.raises(RequestError) as info:
                engine.stream([1, -5])
            assert info.value.param == "prompt"
            with pytest.raises(RequestError) as info:
                engine.stream("fine prompt", logit_bias={10**9: 1.0})
            assert info.value.param == "logit_bias"
            assert spy.requests == []
            assert num_live_states(engine) == (0, 0)
            assert engine.stats()["num_queued"] == 0
            # What fits runs: max_tokens=None fills the rest of the context.
            out = await engine.stream(list(range(10, 20)), max_tokens=54)
            assert out.token_ids == [*range(10, 20), 2]
            out = await engine.stream(list(range(10, 20)), ignore_eos=True, max_tokens=None)
            assert len(out.token_ids) == 54
            assert out.finish_reason == "length"

    run(main())


def test_a_lazy_stream_raises_its_request_error_on_first_read() -> None:
    async def main() -> None:
        engine = echo_engine(max_model_len=64)
        try:
            stream = engine.stream(list(range(10, 80)))  # not started: nothing checked yet
            with pytest.raises(RequestError) as info:
                await stream
            assert info.value.param == "prompt"
            assert num_live_states(engine) == (0, 0)
        finally:
            await engine.aclose()

    run(main())


INVALID = [
    ("n", 0),
    ("n", 2.0),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("seed", "42"),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("logprobs", -1),
    ("logprobs", True),
    ("logit_bias", {5: 101.0}),
    ("stream_interval", 0),
    ("output_kind", "sometimes"),
    ("priority", 1.5),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_sampling_values_raise_request_error_naming_the_field(
    field: str, value: Any
) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)


def test_invalid_overrides_raise_from_stream_and_register_nothing() -> None:
    async def main() -> None:
        async with echo_engine() as engine:
            spy = AddSpy(engine)
            for field, value in INVALID:
                with pytest.raises(RequestError) as info:
                    engine.stream("hello", **{field: value})
                assert info.value.param == field
            with pytest.raises(RequestError) as info:
                engine.stream("hello", SamplingParams(max_tokens=4), min_tokens=5)
            assert info.value.param == "min_tokens"
            with pytest.raises(RequestError) as info:
                engine.stream("hello", no_such_field=1)
            assert info.value.param == "no_such_field"
            assert spy.requests == []
            assert num_live_states(engine) == (0, 0)

    run(main())


def test_engine_limits_on_n_and_logprobs_are_enforced_by_stream() -> None:
    # NOTE: the one check of how many choices and logprobs a request may ask for: params
    # alone hold any positive n and any logprobs >= 0.
    assert SamplingParams(n=129, logprobs=21).n == 129

    async def main() -> None:
        async with echo_engine(max_n=4, max_logprobs=5) as engine:
            with pytest.raises(RequestError) as info:
                engine.stream("hello", n=5)
            assert info.value.param == "n"
            with pytest.raises(RequestError) as info:
                engine.stream("hello", logprobs=6)
            assert info.value.param == "logprobs"

    run(main())


def test_unknown_engine_options_are_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="did you mean 'max_queued_requests'") as info:
        Engine(runner="echo", max_queued_requestz=3)
    assert info.value.option == "max_queued_requestz"
    with pytest.raises(ConfigError):
        Engine(runner="echo", stream_interval=0)
