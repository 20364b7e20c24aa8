"""A grammar compiler over the real SmolLM2 tokenizer, closed (children killed) at the end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from inlinelm.structured.compiler import GrammarCompiler
from inlinelm.structured.sandbox import TokenizerSource


def make_compiler(tokenizer: Any, **options: Any) -> GrammarCompiler:
    """A compiler for ``tokenizer``; close it when done."""
    return GrammarCompiler(lambda: TokenizerSource.from_hf(tokenizer), **options)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    """One compiler per test module (64 grammars cached)."""
    compiler = make_compiler(tokenizer, cache_size=64)
    yield compiler
    compiler.close()
