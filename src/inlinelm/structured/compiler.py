"""Compile a :class:`StructuredOutput` into a validated llguidance grammar, once per text.

Runs on the engine's grammar worker threads (never on the event loop nor the engine
thread: a large schema takes milliseconds to seconds). The result is cached by
``(kind, text)``: the same schema never compiles twice, even when two requests ask for it
at the same moment (the second waits for the first's compilation).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inlinelm.errors import RequestError
from inlinelm.structured.matcher import GrammarMatcher
from inlinelm.structured.spec import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_PARAM = "structured"
# Lark's own syntax (llguidance's dialect): a `start:` rule or a `%llguidance` directive;
# anything else is read as GBNF (`root ::= ...`) and converted.
_GBNF = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")
# JSON output is compact with one space after "," and ":" (json.dumps' look): flexible
# whitespace lets a model pad forever. A schema can override it with "x-guidance".
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar llguidance accepted for this tokenizer, and a matcher template to copy."""

    grammar: str
    template: Any  # llguidance.LLMatcher at its start state, never advanced
    vocab_size: int

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (one per choice)."""
        return GrammarMatcher(self.template.deep_copy(), self.vocab_size)


@dataclass(slots=True)
class CacheStats:
    """Compilations served from the cache (hits) and compiled (misses)."""

    hits: int = 0
    misses: int = 0


class GrammarCompiler:
    """Turns ``StructuredOutput`` into :class:`CompiledGrammar`, with an LRU cache.

    ``make_tokenizer`` builds the ``llguidance.LLTokenizer`` (about a second for a 49k
    vocabulary), on the first compilation, so engines that never see a grammar skip it.
    Thread-safe.
    """

    def __init__(self, make_tokenizer: Callable[[], Any], cache_size: int) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: Any = None
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future[CompiledGrammar]]
        self._cache = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of ``spec``; ``RequestError(param="structured")`` with the
        compiler's message when llguidance refuses it (errors are cached too)."""
        key = (spec.kind, spec.text)
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if future is None:
                self.stats.misses += 1
                future = self._cache[key] = concurrent.futures.Future()
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.stats.hits += 1
        if owner:
            try:
                future.set_result(self._compile(spec))
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        import llguidance

        tokenizer = self._llg_tokenizer()
        grammar = to_llguidance(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise RequestError(_message(spec, messages[0] if messages else ""), param=_PARAM)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise RequestError(_message(spec, template.get_error()), param=_PARAM)
        return CompiledGrammar(grammar, template, tokenizer.vocab_size)

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = self._make_tokenizer()
                except ValueError as e:
                    raise RequestError(
                        f"structured output needs a fast tokenizer: {e}", param=_PARAM
                    ) from e
            return self._tokenizer


def to_llguidance(spec: StructuredOutput) -> str:
    """The llguidance grammar text of ``spec`` (not validated yet)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        if spec.kind in ("json_schema", "json_object"):
            return str(LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS))
        if spec.kind == "regex":
            return str(LLMatcher.grammar_from_regex(spec.text))
        if spec.kind == "choice":
            return str(LLMatcher.grammar_from_lark(_choice_lark(spec.choices)))
        text = gbnf_to_lark(spec.text) if _GBNF.search(spec.text) else spec.text
        return str(LLMatcher.grammar_from_lark(text))
    except Exception as e:  # the GBNF converter raises plain exceptions on bad input
        raise RequestError(_message(spec, str(e)), param=_PARAM) from e


def _choice_lark(choices: list[str]) -> str:
    """``start: "a" | "b"`` with each choice a JSON-escaped Lark string literal."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(spec: StructuredOutput, detail: str) -> str:
    what = {
        "json_schema": "JSON schema",
        "json_object": "JSON object",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar",
    }[spec.kind]
    return f"invalid {what}: {detail.strip()}"
