"""Hostile grammars for the compiler and API tests: chains that recurse deeper than a
thread's stack, a regex whose first mask is slow, a compile that takes a minute, a grammar
that fails mid-generation, objects with many optional properties."""

from __future__ import annotations

import json
from typing import Any

from inlinelm.structured import StructuredOutput


def lark_chain(n: int) -> StructuredOutput:
    rules = "\n".join(f"a{i}: a{i + 1}" for i in range(n))
    return StructuredOutput.grammar(f'start: a0\n{rules}\na{n}: "x"\n')


def gbnf_chain(n: int) -> StructuredOutput:
    rules = "\n".join(f"a{i} ::= a{i + 1}" for i in range(n))
    return StructuredOutput.grammar(f'root ::= a0\n{rules}\na{n} ::= "x"\n')


def ref_chain_defs(n: int) -> dict[str, Any]:
    """``$defs`` of ``n`` objects, each the only property of the one before (d0 .. dn)."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x"],
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return defs


def ref_chain(n: int) -> StructuredOutput:
    return StructuredOutput.json_schema({"$ref": "#/$defs/d0", "$defs": ref_chain_defs(n)})


# llguidance's GBNF converter is quadratic in the rules: about a minute for this many, in
# the child, far past any timeout below.
SLOW = gbnf_chain(24000)
REGEX_BOMB = StructuredOutput.regex("((a{100}){100}){100}")


def optional_object(n: int) -> StructuredOutput:
    properties = {f"p{i}": {"type": "integer"} for i in range(n)}
    return StructuredOutput.json_schema({"type": "object", "properties": properties})


# Passes the compile-time probe (its first mask allows many tokens), then needs a parser
# row of 2,100 items after its first character: llguidance refuses it mid-generation.
FAILS_LATER = 'start: ("a" | "b") (' + " | ".join(json.dumps(f"x{i}") for i in range(2100)) + ")"
