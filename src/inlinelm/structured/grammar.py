"""A compiled grammar, and how this process compiles one a child process has accepted.

:func:`compile_grammar` is steps 1 to 3 of :mod:`.compiler` for one grammar, on the calling
grammar thread: the child's verdict (:meth:`~inlinelm.structured.sandbox.Sandbox.run`), the
compile here, and the first mask computed once so the lexer states every matcher shares are
warm. A grammar the child or llguidance refuses raises a
:class:`~inlinelm.errors.RequestError` naming ``structured``; a child that dies or outruns
its timeout raises the sandbox's own errors, which the compiler turns into refusals.

:class:`CompiledGrammar` is immutable and shared by every request that asks for its text;
each request takes its own :meth:`~CompiledGrammar.new_matcher`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inlinelm.errors import RequestError
from inlinelm.structured.matcher import GrammarMatcher
from inlinelm.structured.sandbox import Sandbox
from inlinelm.structured.sandbox_main import KIND_NAMES
from inlinelm.structured.spec import StructuredOutput

PARAM = "structured"
"""The request parameter a refused grammar's ``RequestError`` names."""

MASK_BUDGET_S = 0.2
"""CPU seconds a grammar's first token mask may take in the child's probe. Masks run on
the engine thread, where every running request waits for them; a first mask past this is
refused (``((a{100}){100}){100}`` takes 1.5 s). Typical grammars take 0.1 to 40 ms."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar llguidance accepted for this tokenizer, and a matcher template to copy.

    ``num_bytes`` is the compiled grammar's estimated memory (what the cache counts).
    """

    grammar: str
    template: Any  # llguidance.LLMatcher at its start state, never advanced
    vocab_size: int
    num_bytes: int = 0

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (one per choice)."""
        return GrammarMatcher(self.template.deep_copy(), self.vocab_size)


def compile_grammar(
    spec: StructuredOutput,
    sandbox: Sandbox,
    timeout_s: float,
    tokenizer: Callable[[], Any],
) -> CompiledGrammar:
    """``spec`` compiled by ``sandbox``'s child within ``timeout_s``, then here with the
    ``llguidance.LLTokenizer`` that ``tokenizer`` gives (asked for only once the child
    accepted the grammar), its first mask computed once."""
    import llguidance

    job = {"kind": spec.kind, "text": spec.text, "mask_budget_s": MASK_BUDGET_S}
    reply = sandbox.run(job, timeout_s)
    if not reply["ok"]:
        raise RequestError(reply["error"], param=PARAM)
    llg_tokenizer = tokenizer()
    template = llguidance.LLMatcher(llg_tokenizer, reply["grammar"], log_level=0)
    if template.is_error():
        message = f"invalid {KIND_NAMES[spec.kind]}: {template.get_error()}"
        raise RequestError(message, param=PARAM)
    compiled = CompiledGrammar(
        reply["grammar"], template, llg_tokenizer.vocab_size, int(reply["bytes"])
    )
    _warm(compiled)
    return compiled


def _warm(compiled: CompiledGrammar) -> None:
    """Compute the first mask once, on a copy: its lexer states are shared by every copy."""
    import ctypes

    words = -(-compiled.vocab_size // 32)
    mask = (ctypes.c_uint32 * words)()
    compiled.template.deep_copy().unsafe_compute_mask_ptr(ctypes.addressof(mask), words * 4)
