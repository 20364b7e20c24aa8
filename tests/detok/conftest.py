"""Fixtures for the detokenizer tests: the SmolLM2 tokenizer's backend and its awkward ids."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

CHAT_PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def backend(tokenizer: Any) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind the SmolLM2 tokenizer."""
    result: Tokenizer = tokenizer.backend_tokenizer
    return result


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Any) -> list[int]:
    """A chat prompt that ends where the assistant's answer starts."""
    ids: list[int] = tokenizer.encode(CHAT_PROMPT, add_special_tokens=False)
    return ids


@pytest.fixture(scope="session")
def awkward_ids(backend: Tokenizer) -> list[int]:
    """Ids that make decoding hard: single bytes, specials, partial characters, a literal U+FFFD."""
    vocab = backend.get_vocab()
    single_bytes = sorted(i for token, i in vocab.items() if len(token) == 1)
    partial = sorted(i for i in vocab.values() if backend.decode([i]).endswith("\ufffd"))[:64]
    specials = list(range(17))
    return single_bytes + partial + specials + [vocab["ï¿½"]]
