"""The chaos mix: one seeded plan of concurrent streams over HTTP and the Python API.

Each scenario checks its own outcome and records what went wrong in a shared
:class:`~tests.chaos.helpers.Problems`; a scenario that hangs past ``SCENARIO_S`` is a
problem too, so a hang shows up as a failure with the scenario named, never as a stuck suite.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from inlinelm import Engine, RequestError, RequestStream
from inlinelm.structured import StructuredOutput
from tests.chaos.helpers import Problems, SseReading, echo_answer, read_sse
from tests.runtime.helpers import prompt_ids
from tests.structured.grammars import FAILS_LATER, lark_chain, optional_object, ref_chain

SCENARIO_S = 20.0
"""A scenario still running after this long is recorded as hung."""

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "maple",
    "orbit",
    "lantern",
    "copper",
    "violet",
    "harbor",
    "meadow",
    "signal",
    "quartz",
    "ember",
    "falcon",
    "willow",
    "summit",
]

KINDS = {
    "normal": 22,
    "stop": 10,
    "n": 8,
    "slow": 8,
    "disconnect": 16,
    "cancel": 12,
    "bad": 12,
    "duplicate_id": 6,
    "reuse_after_abort": 6,
    "hostile": 6,
    "long_stop": 4,
}
PYTHON_ONLY = {"duplicate_id", "reuse_after_abort"}

# name → SamplingParams overrides of a request that must be refused before the engine.
BAD_REQUESTS: dict[str, dict[str, Any]] = {
    "max_tokens=0": {"max_tokens": 0},
    "logit_bias id outside the vocabulary": {"logit_bias": {10**9: 1.0}},
    "logit_bias value out of range": {"logit_bias": {5: 1000.0}},
    "seed 2**70": {"seed": 2**70},
    "stop_token_ids=[10**9] with min_tokens=1": {"stop_token_ids": [10**9], "min_tokens": 1},
    "unknown field": {"bogus_field": 1},
}


# name → a constraint built to crash, stall or outwit the grammar compiler (issue 19): each
# is refused with a RequestError naming "structured" (a 400), or, for the one that fails
# mid-generation, ends its own stream with an error. Variants of each keep some compiles
# uncached, so children crash and time out during the mix.
HOSTILE: dict[str, Callable[[int], StructuredOutput]] = {
    "3,000 chained Lark rules": lambda i: lark_chain(3000 + i),
    "a 1,000-deep $ref chain": lambda i: ref_chain(1000 + i),
    "a regex whose first mask is slow": lambda i: StructuredOutput.regex(
        f"((a{{{100 + i}}}){{100}}){{100}}"
    ),
    "401 optional properties": lambda i: optional_object(401 + i),
    "a grammar that fails after its first token": lambda i: StructuredOutput.grammar(FAILS_LATER),
}
NUM_HOSTILE_VARIANTS = 2
MID_REQUEST = "a grammar that fails after its first token"


# Stop strings at the engine's caps (EngineConfig.max_stop_strings, max_stop_string_chars):
# fifteen of 1,024 characters that never occur, plus one word of the prompt.
LONG_STOPS = [chr(0x3A9 + i) * 1023 + "x" for i in range(15)]


def http_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    """The JSON body fields for ``overrides`` (logit_bias keys are strings in JSON)."""
    body = dict(overrides)
    if "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
    return body


@dataclass
class PyReading:
    """What one Python-API stream delivered, per choice."""

    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    num_outputs: int = 0
    finished: bool = False


async def read_py(
    stream: RequestStream,
    *,
    leave_after: int | None = None,
    slow_s: float = 0.0,
    on_output: Callable[[int], None] | None = None,
) -> PyReading:
    """Read ``stream`` (deltas) to its end, or break out after ``leave_after`` outputs."""
    reading = PyReading()
    async for out in stream:
        for choice in out.outputs:
            reading.texts[choice.index] = reading.texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reading.reasons[choice.index] = choice.finish_reason
        reading.num_outputs += 1
        reading.finished = out.finished
        if on_output is not None:
            on_output(reading.num_outputs)
        if leave_after is not None and reading.num_outputs >= leave_after:
            break  # NOTE: the generator is finalized (and the request aborted) by the loop.
        if slow_s:
            await asyncio.sleep(slow_s)  # the slow reader under test, not a wait
    return reading


def check_texts(
    problems: Problems,
    label: str,
    got: dict[int, str],
    reasons: dict[int, str],
    expected: str,
    n: int = 1,
) -> None:
    """Every choice has exactly ``expected`` and a real (not abort) finish reason."""
    want = dict.fromkeys(range(n), expected)
    problems.check(got == want, f"{label}: texts {got!r} != expected {want!r}")
    bad = {i: r for i, r in reasons.items() if r not in ("stop", "length")}
    problems.check(
        len(reasons) == n and not bad, f"{label}: finish reasons {reasons!r} (want stop/length)"
    )


async def until_count_or_done(task: asyncio.Task[Any], reached: asyncio.Event) -> None:
    """Wait until ``reached`` is set or ``task`` ended (no helper task is left behind)."""
    waiter = asyncio.ensure_future(reached.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)


class Mix:
    """Plans and runs ``num`` seeded scenarios at once against one engine."""

    def __init__(
        self,
        engine: Engine,
        client: httpx.AsyncClient,
        url: str,
        rng: random.Random,
        problems: Problems,
        exclude: Collection[str] = (),
    ) -> None:
        unknown = set(exclude) - set(KINDS)
        assert not unknown, f"unknown scenario kinds {unknown}; known: {sorted(KINDS)}"
        self.kinds = {k: w for k, w in KINDS.items() if k not in exclude}
        self.engine = engine
        self.client = client
        self.url = url
        self.rng = rng
        self.problems = problems
        self.counts: collections.Counter[str] = collections.Counter()
        self.hung: collections.Counter[str] = collections.Counter()

    async def run(self, num: int) -> None:
        """Draw ``num`` scenarios from the seed, start them all, wait (bounded) for each."""
        plan = [self._draw(i) for i in range(num)]
        await asyncio.gather(*(self._guard(label, make) for label, make in plan))

    def _draw(self, i: int) -> tuple[str, Callable[[], Awaitable[None]]]:
        kind = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
        transport = "py" if kind in PYTHON_ONLY or self.rng.random() < 0.5 else "http"
        self.counts[f"{kind}/{transport}"] += 1
        label = f"#{i} {kind}/{transport}"
        method = getattr(self, f"_{kind}_{transport}")
        args = self._args(kind)
        return label, lambda: method(label, *args)

    def _args(self, kind: str) -> tuple[Any, ...]:
        """Draw every random choice of a scenario now, in plan order, so runs reproduce."""
        rng = self.rng
        words = rng.sample(WORDS, rng.randint(3, 8))
        prompt = " ".join(words)
        max_tokens = rng.randint(8, 32)
        if kind == "stop":
            return prompt, max_tokens, rng.choice(words[1:])
        if kind == "n":
            return prompt, max_tokens, rng.randint(2, 4)
        if kind == "slow":
            return prompt, max_tokens, rng.uniform(0.002, 0.008)
        if kind == "disconnect":
            return prompt, rng.randint(1, 3), rng.choice(["break", "aclose", "agen_aclose"])
        if kind == "cancel":
            return prompt, rng.randint(0, 3)
        if kind == "bad":
            return prompt, rng.choice(sorted(BAD_REQUESTS))
        if kind == "long_stop":
            return prompt, max_tokens, rng.choice(words[1:])
        if kind == "hostile":
            return prompt, rng.choice(sorted(HOSTILE)), rng.randrange(NUM_HOSTILE_VARIANTS)
        if kind == "reuse_after_abort":
            return prompt, max_tokens, rng.choice(["aclose", "agen_aclose", "cancel"])
        if kind == "normal":
            return prompt, max_tokens, rng.random() < 0.3
        return prompt, max_tokens

    async def scenario(self, label: str, kind: str, transport: str, *args: Any) -> None:
        """Run one scenario by name (guarded like the mix's), e.g. to repeat one kind."""
        self.counts[f"{kind}/{transport}"] += 1
        method = getattr(self, f"_{kind}_{transport}")
        await self._guard(label, lambda: method(label, *args))

    async def _guard(self, label: str, make: Callable[[], Awaitable[None]]) -> None:
        try:
            await asyncio.wait_for(make(), SCENARIO_S)
        except asyncio.TimeoutError:
            self.hung[label.split(" ")[1]] += 1
            self.problems.add(f"{label}: still running after {SCENARIO_S} s (hung)")
        except Exception as exc:
            self.problems.add(f"{label}: raised {type(exc).__name__}: {exc}")

    # -- helpers -------------------------------------------------------------------------

    def _expected(self, prompt: str, max_tokens: int, stop: str | None = None) -> str:
        return echo_answer(self.engine, prompt_ids(self.engine, prompt), max_tokens, stop)

    def _completions(self, **fields: Any) -> tuple[str, dict[str, Any]]:
        return f"{self.url}/v1/completions", {"stream": True, **fields}

    async def _sse(self, fields: dict[str, Any], **options: Any) -> SseReading:
        url, body = self._completions(**fields)
        return await read_sse(self.client, url, body, **options)

    def _check_sse(self, label: str, reading: SseReading, expected: str, n: int = 1) -> None:
        ok = self.problems.check(
            reading.status == 200, f"{label}: HTTP {reading.status} {reading.body}"
        )
        if not ok:
            return
        self.problems.check(not reading.errors, f"{label}: error frames {reading.errors}")
        self.problems.check(reading.done, f"{label}: no [DONE]")
        check_texts(self.problems, label, reading.texts, reading.reasons, expected, n)

    # -- normal, stop strings, n > 1, slow readers ------------------------------------------

    async def _normal_py(self, label: str, prompt: str, max_tokens: int, chat: bool) -> None:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            ids = self.engine.tokenizer.encode(
                self.engine.render_chat(messages), add_special_tokens=False
            )
            reading = await read_py(self.engine.chat(messages, max_tokens=max_tokens))
            expected = echo_answer(self.engine, ids, max_tokens)
        else:
            reading = await read_py(self.engine.stream(prompt, max_tokens=max_tokens))
            expected = self._expected(prompt, max_tokens)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected)

    async def _normal_http(self, label: str, prompt: str, max_tokens: int, chat: bool) -> None:
        if not chat:
            reading = await self._sse({"prompt": prompt, "max_tokens": max_tokens})
            self._check_sse(label, reading, self._expected(prompt, max_tokens))
            return
        messages = [{"role": "user", "content": prompt}]
        ids = self.engine.tokenizer.encode(
            self.engine.render_chat(messages), add_special_tokens=False
        )
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True}
        reading = await read_sse(self.client, f"{self.url}/v1/chat/completions", body)
        self._check_sse(label, reading, echo_answer(self.engine, ids, max_tokens))

    async def _stop_py(self, label: str, prompt: str, max_tokens: int, stop: str) -> None:
        reading = await read_py(self.engine.stream(prompt, max_tokens=max_tokens, stop=[stop]))
        expected = self._expected(prompt, max_tokens, stop)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected)

    async def _stop_http(self, label: str, prompt: str, max_tokens: int, stop: str) -> None:
        reading = await self._sse({"prompt": prompt, "max_tokens": max_tokens, "stop": [stop]})
        self._check_sse(label, reading, self._expected(prompt, max_tokens, stop))

    async def _n_py(self, label: str, prompt: str, max_tokens: int, n: int) -> None:
        reading = await read_py(self.engine.stream(prompt, max_tokens=max_tokens, n=n))
        expected = self._expected(prompt, max_tokens)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected, n)

    async def _n_http(self, label: str, prompt: str, max_tokens: int, n: int) -> None:
        reading = await self._sse({"prompt": prompt, "max_tokens": max_tokens, "n": n})
        self._check_sse(label, reading, self._expected(prompt, max_tokens), n)

    async def _slow_py(self, label: str, prompt: str, max_tokens: int, slow_s: float) -> None:
        stream = self.engine.stream(prompt, max_tokens=max_tokens)
        reading = await read_py(stream, slow_s=slow_s)
        expected = self._expected(prompt, max_tokens)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected)

    async def _slow_http(self, label: str, prompt: str, max_tokens: int, slow_s: float) -> None:
        reading = await self._sse({"prompt": prompt, "max_tokens": max_tokens}, slow_s=slow_s)
        self._check_sse(label, reading, self._expected(prompt, max_tokens))

    # -- disconnects and cancellations -------------------------------------------------------

    async def _disconnect_py(self, label: str, prompt: str, after: int, how: str) -> None:
        stream = self.engine.stream(prompt, max_tokens=32, ignore_eos=True)
        if how == "break":
            await read_py(stream, leave_after=after)
            return
        iterator = stream.__aiter__()
        with contextlib.suppress(StopAsyncIteration):  # it ended before the reader left
            for _ in range(after):
                await iterator.__anext__()
        if how == "aclose":
            await stream.aclose()
        await iterator.aclose()

    async def _disconnect_http(self, label: str, prompt: str, after: int, how: str) -> None:
        fields = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True}
        reading = await self._sse(fields, leave_after=after)
        self.problems.check(reading.status == 200, f"{label}: HTTP {reading.status} {reading.body}")
        self.problems.check(not reading.errors, f"{label}: error frames {reading.errors}")

    async def _cancel(
        self,
        label: str,
        read: Callable[[Callable[[int], None]], Coroutine[Any, Any, Any]],
        after: int,
    ) -> None:
        reached = asyncio.Event()

        def on_count(count: int) -> None:
            if count >= after:
                reached.set()

        task = asyncio.create_task(read(on_count))
        if after:
            await until_count_or_done(task, reached)
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
        result = results[0]
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            self.problems.add(f"{label}: the cancelled reader raised {result!r}")

    async def _cancel_py(self, label: str, prompt: str, after: int) -> None:
        stream = self.engine.stream(prompt, max_tokens=32, ignore_eos=True)
        await self._cancel(label, lambda on: read_py(stream, on_output=on), after)

    async def _cancel_http(self, label: str, prompt: str, after: int) -> None:
        fields = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True}
        await self._cancel(label, lambda on: self._sse(fields, on_frame=on), after)

    # -- bad requests --------------------------------------------------------------------------

    async def _bad_py(self, label: str, prompt: str, case: str) -> None:
        try:
            stream = self.engine.stream(prompt, **{"max_tokens": 8, **BAD_REQUESTS[case]})
        except RequestError:
            return
        self.problems.add(f"{label}: {case} was accepted (want RequestError)")
        await read_py(stream)

    async def _bad_http(self, label: str, prompt: str, case: str) -> None:
        fields = {"prompt": prompt, "max_tokens": 8, **http_fields(BAD_REQUESTS[case])}
        reading = await self._sse(fields)
        ok = reading.status == 400 and isinstance(reading.body, dict) and "error" in reading.body
        self.problems.check(ok, f"{label}: {case} got HTTP {reading.status} (want 400)")

    # -- hostile constraints and stop strings at the caps ---------------------------------------

    async def _hostile_py(self, label: str, prompt: str, case: str, variant: int) -> None:
        spec = HOSTILE[case](variant)
        try:
            await read_py(self.engine.stream(prompt, max_tokens=8, structured=spec))
        except RequestError as exc:
            self.problems.check(
                exc.param == "structured", f"{label}: {case}: RequestError names {exc.param!r}"
            )
            return
        self.problems.add(f"{label}: {case} was accepted (want RequestError)")

    async def _hostile_http(self, label: str, prompt: str, case: str, variant: int) -> None:
        spec = HOSTILE[case](variant)
        field = "guided_json" if spec.kind == "json_schema" else f"guided_{spec.kind}"
        value: Any = json.loads(spec.text) if spec.kind == "json_schema" else spec.text
        reading = await self._sse({"prompt": prompt, "max_tokens": 8, field: value})
        if case == MID_REQUEST:
            params = [e.get("param") for e in reading.errors]
            ok = reading.status == 200 and params == ["structured"] and reading.done
            self.problems.check(ok, f"{label}: {case}: HTTP {reading.status}, errors {params}")
            self.problems.check(
                "stop" not in reading.reasons.values(), f"{label}: {case} ended with 'stop'"
            )
            return
        param = (
            reading.body.get("error", {}).get("param") if isinstance(reading.body, dict) else None
        )
        ok = reading.status == 400 and param == "structured"
        self.problems.check(ok, f"{label}: {case}: HTTP {reading.status} {reading.body} (want 400)")

    async def _long_stop_py(self, label: str, prompt: str, max_tokens: int, stop: str) -> None:
        stream = self.engine.stream(prompt, max_tokens=max_tokens, stop=[*LONG_STOPS, stop])
        reading = await read_py(stream)
        expected = self._expected(prompt, max_tokens, stop)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected)

    async def _long_stop_http(self, label: str, prompt: str, max_tokens: int, stop: str) -> None:
        fields = {"prompt": prompt, "max_tokens": max_tokens, "stop": [*LONG_STOPS, stop]}
        reading = await self._sse(fields)
        self._check_sse(label, reading, self._expected(prompt, max_tokens, stop))

    # -- request ids ---------------------------------------------------------------------------

    async def _duplicate_id_py(self, label: str, prompt: str, max_tokens: int) -> None:
        rid = f"dup-{label.split(' ')[0][1:]}"
        first = self.engine.stream(prompt, request_id=rid, max_tokens=max_tokens)
        try:
            second = self.engine.stream("a different prompt", request_id=rid, max_tokens=4)
        except RequestError:
            pass
        else:
            self.problems.add(f"{label}: a second live stream with id {rid!r} was accepted")
            await asyncio.gather(read_py(second), return_exceptions=True)
        reading = await read_py(first)
        expected = self._expected(prompt, max_tokens)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected)

    async def _reuse_after_abort_py(
        self, label: str, prompt: str, max_tokens: int, how: str
    ) -> None:
        rid = f"reuse-{label.split(' ')[0][1:]}"
        first = self.engine.stream(
            "the first, aborted", request_id=rid, max_tokens=64, ignore_eos=True
        )
        iterator = first.__aiter__()
        if how == "cancel":
            got_one = asyncio.Event()

            async def consume() -> None:
                async for _ in iterator:
                    got_one.set()

            task = asyncio.create_task(consume())
            await until_count_or_done(task, got_one)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await iterator.__anext__()
            if how == "aclose":
                await first.aclose()
            else:
                await iterator.aclose()
        second = self.engine.stream(prompt, request_id=rid, max_tokens=max_tokens)
        reading = await read_py(second)
        await iterator.aclose()
        expected = self._expected(prompt, max_tokens)
        check_texts(self.problems, label, reading.texts, reading.reasons, expected)
