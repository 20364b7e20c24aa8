"""The grammar compiler: every kind compiles, refusals are RequestErrors with the compiler's
message, and the cache compiles each (kind, text) once, even under concurrent requests."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

from inlinelm.errors import RequestError
from inlinelm.structured import StructuredOutput
from inlinelm.structured.compiler import GrammarCompiler
from tests.structured.conftest import make_compiler

VALID = [
    StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutput.json_object(),
    StructuredOutput.regex(r"[a-z]+\d?"),
    StructuredOutput.choice(['say "hi"', "back\\slash", "ünï"]),
    StructuredOutput.grammar('start: "x" NUM\nNUM: /[0-9]+/'),
    StructuredOutput.grammar('root ::= "yes" | "no"'),  # GBNF
]
INVALID = [
    (StructuredOutput.json_schema({"type": "nonsense"}), "invalid JSON schema"),
    (StructuredOutput.json_schema({"$ref": "#/missing"}), "invalid JSON schema"),
    (StructuredOutput.regex("a(b"), "invalid regex"),
    (StructuredOutput.grammar("start: undefined_rule"), "invalid grammar"),
    (StructuredOutput.grammar("root ::= missing"), "invalid grammar"),
]


@pytest.mark.parametrize("spec", VALID, ids=lambda s: s.kind)
def test_each_kind_compiles_to_a_fresh_matcher(
    compiler: GrammarCompiler, spec: StructuredOutput
) -> None:
    compiled = compiler.compile(spec)
    matcher = compiled.new_matcher()
    assert matcher.error is None and not matcher.is_stopped
    assert matcher.vocab_size == 49152


def test_choice_literals_are_escaped(compiler: GrammarCompiler, tokenizer: Any) -> None:
    for choice in ['say "hi"', "back\\slash", "ünï"]:
        matcher = compiler.compile(VALID[3]).new_matcher()
        for token in tokenizer.encode(choice):
            assert matcher.accept(token), choice
        assert matcher.accept(tokenizer.eos_token_id)
        assert matcher.is_stopped


@pytest.mark.parametrize(("spec", "message"), INVALID, ids=lambda x: getattr(x, "kind", ""))
def test_refused_grammar_is_a_request_error(
    compiler: GrammarCompiler, spec: StructuredOutput, message: str
) -> None:
    with pytest.raises(RequestError, match=message) as info:
        compiler.compile(spec)
    assert info.value.param == "structured"
    with pytest.raises(RequestError, match=message):
        compiler.compile(spec)  # the refusal is cached too


def test_cache_compiles_each_text_once(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer, cache_size=2)
    try:
        spec = StructuredOutput.json_schema({"type": "array", "items": {"type": "boolean"}})
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(compiler.compile, [spec] * 8))
        assert all(r is results[0] for r in results)
        assert (compiler.stats.hits, compiler.stats.misses) == (7, 1)
        # LRU: two more texts evict the first
        compiler.compile(StructuredOutput.regex("a"))
        compiler.compile(StructuredOutput.regex("b"))
        assert compiler.compile(spec) is not results[0]
        assert compiler.stats.misses == 4
    finally:
        compiler.close()
