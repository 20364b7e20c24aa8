"""Structured output through the whole engine on the tiny random model (CPU): whatever the
model would say, the output fits the schema, regex, choices or grammar; a bad constraint
is a RequestError from submit; unconstrained neighbours are untouched."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inlinelm import Engine, SamplingParams
from inlinelm.errors import RequestError
from inlinelm.structured import StructuredOutput
from tests.helpers import loaded_of
from tests.runtime.helpers import WAIT_S, assert_drained, run, wait_until
from tests.structured.grammars import FAILS_LATER, gbnf_chain

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "level": {"type": "integer", "minimum": -5, "maximum": 5},
            "tier": {"enum": ["gold", "silver", None]},
        },
        "required": ["name", "age", "tier"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["id"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["owner", "tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 10, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=80)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine(model=str(tiny_model_dir), runner="model", num_kv_blocks=256)
    engine.start_sync()
    yield engine
    engine.close()


def _text(engine: Engine, prompt: str, params: SamplingParams) -> tuple[str, str | None]:
    async def main() -> tuple[str, str | None]:
        out = await engine.stream(prompt, params)
        return out.outputs[0].text, out.outputs[0].finish_reason

    return run(main(), timeout=120)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "array"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(
    engine: Engine, schema: dict[str, Any], temperature: float
) -> None:
    params = GREEDY.with_overrides(
        temperature=temperature, seed=7, structured=StructuredOutput.json_schema(schema)
    )
    text, reason = _text(engine, "Give me JSON:", params)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_output_parses(engine: Engine) -> None:
    params = GREEDY.with_overrides(
        max_tokens=200, temperature=1.0, seed=3, structured=StructuredOutput.json_object()
    )
    text, reason = _text(engine, "Any object:", params)
    if reason == "stop":  # a random model may nest past max_tokens
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


@pytest.mark.parametrize(
    "pattern", [r"[a-c]{3}-\d{2}", r"(cat|dog)s? [0-9]{1,3}", r"\w{2,5}@x\.io"]
)
def test_regex_output_matches(engine: Engine, pattern: str) -> None:
    params = GREEDY.with_overrides(structured=StructuredOutput.regex(pattern))
    text, reason = _text(engine, "Pattern:", params)
    assert reason == "stop"
    assert re.fullmatch(pattern, text), text


def test_choice_output_is_one_choice(engine: Engine) -> None:
    choices = ["yes", "no", 'maybe "later"']
    for seed in range(4):
        params = GREEDY.with_overrides(
            temperature=1.0, seed=seed, structured=StructuredOutput.choice(choices)
        )
        text, reason = _text(engine, "Answer:", params)
        assert reason == "stop"
        assert text in choices


@pytest.mark.parametrize(
    ("grammar", "language"),
    [
        ('start: "[" ITEM ("," ITEM)? "]"\nITEM: /[xyz]|[0-9]{1,2}/', r"\[(\w{1,2})(,\w{1,2})?\]"),
        ('root ::= "(" digit digit? ")"\ndigit ::= [0-9]', r"\([0-9]{1,2}\)"),  # GBNF
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_output_parses(engine: Engine, grammar: str, language: str) -> None:
    params = GREEDY.with_overrides(structured=StructuredOutput.grammar(grammar))
    text, reason = _text(engine, "Grammar:", params)
    assert reason == "stop"
    assert re.fullmatch(language, text), text


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput.json_schema({"type": "nonsense"}),
        StructuredOutput.regex("a(b"),
        StructuredOutput.grammar("start: nothing_here"),
    ],
    ids=["schema", "regex", "grammar"],
)
def test_invalid_constraint_raises_from_submit(engine: Engine, spec: StructuredOutput) -> None:
    async def main() -> None:
        stream = engine.stream("x", GREEDY.with_overrides(structured=spec))
        with pytest.raises(RequestError) as info:
            await stream.submit()
        assert info.value.param == "structured"
        await assert_drained(engine)

    run(main())


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(engine: Engine) -> None:
    prompts = ["The sea", "Once upon a time", "1, 2, 3,"]
    plain = GREEDY.with_overrides(max_tokens=16, ignore_eos=True)
    constrained = GREEDY.with_overrides(structured=StructuredOutput.json_schema(SCHEMAS[1]))

    async def main() -> tuple[list[str], list[str]]:
        alone = await asyncio.gather(*(engine.stream(p, plain) for p in prompts))
        mixed = await asyncio.gather(
            *(engine.stream(p, plain) for p in prompts),
            *(engine.stream(p, constrained) for p in prompts),
        )
        return [o.outputs[0].text for o in alone], [o.outputs[0].text for o in mixed]

    alone, mixed = run(main(), timeout=120)
    assert mixed[:3] == alone
    for text in mixed[3:]:
        jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_cache_hits_on_the_same_schema(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    params = GREEDY.with_overrides(structured=StructuredOutput.json_schema(schema))
    before = engine.stats()
    _text(engine, "a", params)
    _text(engine, "b", params)
    after = engine.stats()
    assert after["grammar_cache_misses"] - before["grammar_cache_misses"] == 1
    assert after["grammar_cache_hits"] - before["grammar_cache_hits"] == 1


def test_each_choice_of_n_follows_its_own_grammar(engine: Engine) -> None:
    pattern = r"[0-9]{2}(-[a-z]{2})?"
    params = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=20, structured=StructuredOutput.regex(pattern)
    )

    async def main() -> list[str]:
        out = await engine.stream("n choices", params)
        assert [o.finish_reason for o in out.outputs] == ["stop"] * 3
        return [o.text for o in out.outputs]

    texts = run(main())
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_streamed_deltas_add_up_to_valid_json(engine: Engine) -> None:
    params = GREEDY.with_overrides(structured=StructuredOutput.json_schema(SCHEMAS[0]))

    async def main() -> str:
        parts = [out.text async for out in engine.stream("Stream:", params)]
        assert len(parts) > 2
        return "".join(parts)

    jsonschema.validate(json.loads(run(main())), SCHEMAS[0])


def test_echo_runner_follows_the_grammar() -> None:
    async def main() -> None:
        async with Engine(runner="echo") as engine:
            out = await engine.stream(
                "hello there", max_tokens=20, structured=StructuredOutput.choice(["A1", "B2"])
            )
            assert out.outputs[0].text in ("A1", "B2")
            assert out.outputs[0].finish_reason == "stop"

    run(main())


def test_a_stop_string_ends_a_constrained_request_and_frees_it(engine: Engine) -> None:
    """Stop strings are matched on the loop as for any request: the constrained output is
    cut at the stop string, the request is aborted on the engine, nothing is left."""
    pattern = r"[a-c]{4}-[0-9]{6}"
    free = GREEDY.with_overrides(structured=StructuredOutput.regex(pattern))
    full, _ = _text(engine, "Pattern:", free)
    assert re.fullmatch(pattern, full), full
    stop = full[5:7]  # two characters inside the digits: a stop before the grammar ends
    cut = full[: full.index(stop)]
    text, reason = _text(engine, "Pattern:", free.with_overrides(stop=[stop]))
    assert (text, reason) == (cut, "stop")
    run(assert_drained(engine))


def test_a_grammar_failing_mid_request_ends_only_that_request(engine: Engine) -> None:
    """On the real runner: the grammar's failure after its first token is a RequestError
    naming ``structured`` with llguidance's reason; a neighbour finishes; nothing leaks."""
    failing = GREEDY.with_overrides(structured=StructuredOutput.grammar(FAILS_LATER))

    async def main() -> None:
        neighbour = asyncio.ensure_future(
            engine.stream("Hello", GREEDY.with_overrides(max_tokens=8))
        )
        with pytest.raises(RequestError, match="grammar failed at output token") as info:
            await engine.stream("Pattern:", failing)
        assert info.value.param == "structured"
        assert "Current row has" in info.value.message
        assert (await neighbour).outputs[0].finish_reason == "length"
        await assert_drained(engine)

    run(main(), timeout=120)


def test_compiles_whose_clients_left_are_stopped_and_plain_requests_never_wait() -> None:
    """Four requests with minute-long grammars are cancelled while two compile and two
    wait: both compile slots come free for the next grammar, and a plain request is
    answered while the slow ones still run."""

    async def main() -> None:
        async with Engine(runner="echo", grammar_compile_threads=2) as engine:
            slow = [gbnf_chain(24000 + i) for i in range(4)]
            tasks = [
                asyncio.ensure_future(engine.stream("x", max_tokens=4, structured=s)) for s in slow
            ]
            compiler = loaded_of(engine).grammars
            await wait_until(lambda: compiler.stats.misses == 4, what="four compiles started")
            plain = await asyncio.wait_for(engine.stream("plain", max_tokens=4), WAIT_S)
            assert plain.outputs[0].text
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            spec = StructuredOutput.choice(["A1", "B2"])
            out = await asyncio.wait_for(engine.stream("x", max_tokens=8, structured=spec), WAIT_S)
            assert out.outputs[0].text in ("A1", "B2")
            assert compiler.stats.abandoned == 4
            stats = engine.stats()
            assert stats["grammar_compiles_abandoned"] == 4
            assert stats["grammar_cache_entries"] == 1 and stats["grammar_cache_bytes"] > 0
            await assert_drained(engine)

    run(main(), timeout=120)
