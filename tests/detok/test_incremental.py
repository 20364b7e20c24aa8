"""Incremental detokenizers: the tricky cases, one by one, on both paths."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models

import inlinelm.detok
from inlinelm.detok import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    make_detokenizer,
)
from inlinelm.detok.window import KEEP_PENDING_TOKENS, MAX_PENDING_TOKENS
from tests.detok.reference import FFFD, chunked, stream

Make = Callable[..., IncrementalDetokenizer]


@pytest.fixture(params=["fast", "slow"])
def make(request: pytest.FixtureRequest, tokenizer: Any) -> Make:
    """Build a detokenizer on the SmolLM2 tokenizer, on the fast or the slow path."""

    def build(prompt_ids: list[int] | None = None, **options: Any) -> IncrementalDetokenizer:
        prompt = prompt_ids or []
        if request.param == "fast":
            return FastIncrementalDetokenizer(tokenizer.backend_tokenizer, prompt, **options)
        return SlowIncrementalDetokenizer(tokenizer, prompt, **options)

    return build


def byte_ids(backend: Tokenizer, data: bytes) -> list[int]:
    """The byte-level token of each byte (GPT-2's byte-to-unicode table)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in visible}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    ids = [backend.token_to_id(table[b]) for b in data]
    assert all(i is not None for i in ids)
    return [i for i in ids if i is not None]


def single_steps(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """One delta per token, then the final flush."""
    return stream(detok, chunked(ids, [1])).deltas


def test_emoji_split_over_four_byte_tokens_emits_once(make: Make, backend: Tokenizer) -> None:
    ids = byte_ids(backend, "a😀".encode())
    assert single_steps(make(), ids) == ["a", "", "", "", "😀", ""]


def test_leading_space_of_first_token_after_prompt(make: Make, tokenizer: Any) -> None:
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode(" world, again", add_special_tokens=False)
    deltas = single_steps(make(prompt), ids)
    assert deltas[0] == " world"
    assert "".join(deltas) == " world, again"


def test_cjk_comes_out_in_whole_characters(make: Make, tokenizer: Any) -> None:
    text = "你好，世界。日本語と한국어"
    deltas = single_steps(make(), tokenizer.encode(text, add_special_tokens=False))
    assert "".join(deltas) == text
    assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_decode(make: Make, tokenizer: Any, skip: bool) -> None:
    # id 3 (<repo_name>) is special to the tokenizers backend but not in all_special_ids
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), 2, 3, 0, 1, 905, 2]
    text = "".join(single_steps(make(skip_special_tokens=skip), ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_matches_decode(
    tokenizer: Any, skip: bool, spaces: bool
) -> None:
    ids = [1, 2, *tokenizer.encode("a b", add_special_tokens=False), 2, 0, 2]
    expected = tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    # transformers 5 ignores the flag; if that changes, the detokenizer must follow.
    assert expected == tokenizer.decode(ids, skip_special_tokens=skip)
    detok = make_detokenizer(
        tokenizer, [], skip_special_tokens=skip, spaces_between_special_tokens=spaces
    )
    assert stream(detok, [ids]).text == expected


def test_prompt_ending_inside_a_character_lends_no_bytes(make: Make, backend: Tokenizer) -> None:
    emoji = byte_ids(backend, "😀".encode())
    prompt = [*byte_ids(backend, b"ab"), *emoji[:2]]
    ids = [*emoji[2:], *byte_ids(backend, b" x")]
    assert "".join(single_steps(make(prompt), ids)) == backend.decode(ids)


def test_invalid_sequence_inside_text_is_kept(make: Make, backend: Tokenizer) -> None:
    ids = byte_ids(backend, b"\xe4a")
    assert single_steps(make(), ids) == ["", FFFD + "a", ""]


def test_trailing_replacement_char_waits_for_the_finish(make: Make, backend: Tokenizer) -> None:
    ids = byte_ids(backend, b"a\xe4")
    assert single_steps(make(), ids) == ["a", "", FFFD]


def test_literal_replacement_char_loop_is_released_with_bounded_lag(
    make: Make, backend: Tokenizer
) -> None:
    token = backend.token_to_id("ï¿½")
    assert token is not None
    detok = make()
    released = ""
    for step in range(1, 101):
        detok.update([token])
        released += detok.next_output_text(finished=False, delta=True)
        assert step - len(released) <= MAX_PENDING_TOKENS
        assert len(_window_tokens(detok)) <= 2 * MAX_PENDING_TOKENS
    released += detok.next_output_text(finished=True, delta=True)
    assert released == FFFD * 100


def test_run_of_lead_bytes_then_a_character(make: Make, backend: Tokenizer) -> None:
    ids = byte_ids(backend, b"\xe4" * 30 + "你好".encode())
    detok = make()
    deltas = []
    for token in ids:
        detok.update([token])
        deltas.append(detok.next_output_text(finished=False, delta=True))
        assert len(_window_tokens(detok)) <= 2 * MAX_PENDING_TOKENS
    assert "".join(deltas) == backend.decode(ids) == FFFD * 30 + "你好"
    assert all(d.count(FFFD) <= MAX_PENDING_TOKENS - KEEP_PENDING_TOKENS + 1 for d in deltas)


def test_run_of_skipped_special_tokens_keeps_the_window_small(make: Make, tokenizer: Any) -> None:
    detok = make()
    for _ in range(50):
        detok.update([3])
        assert detok.next_output_text(finished=False, delta=True) == ""
        assert len(_window_tokens(detok)) <= 2 * MAX_PENDING_TOKENS
    detok.update(tokenizer.encode(" ok", add_special_tokens=False))
    assert detok.next_output_text(finished=True, delta=True) == " ok"


def test_window_stays_small_on_a_long_answer(make: Make, tokenizer: Any) -> None:
    ids = tokenizer.encode("Some text, 你好 👋🏽 `code`.\n" * 200, add_special_tokens=False)
    detok = make()
    for token in ids:
        detok.update([token])
        assert len(_window_tokens(detok)) <= 8
    assert detok.output_text == tokenizer.decode(ids)


def test_ids_past_the_vocabulary_decode_to_nothing(make: Make, tokenizer: Any) -> None:
    ids = [*tokenizer.encode("a", add_special_tokens=False), 10**6, 905]
    assert stream(make(), [ids]).text == "a world"


def test_stop_string_across_tokens_cuts_and_reports(make: Make, tokenizer: Any) -> None:
    ids = tokenizer.encode("The answer is 42. END of story", add_special_tokens=False)
    detok = make(stop=["END"])
    result = stream(detok, chunked(ids, [1]))
    assert result.stop == "END"
    assert result.text == "The answer is 42. "
    assert detok.stop_reason == "END"
    assert all("E" not in d for d in result.deltas)


def test_include_stop_str_in_output(make: Make, tokenizer: Any) -> None:
    ids = tokenizer.encode("a</s>b", add_special_tokens=False)
    result = stream(make(stop=["</s>"], include_stop_str_in_output=True), chunked(ids, [1]))
    assert (result.stop, result.text) == ("</s>", "a</s>")


def test_min_tokens_exempts_the_first_tokens_text(make: Make, tokenizer: Any) -> None:
    ids = tokenizer.encode("x stop y stop z", add_special_tokens=False)
    first = stream(make(stop=["stop"]), chunked(ids, [1]))
    assert first.text == "x "
    later = stream(make(stop=["stop"], min_tokens=2), chunked(ids, [1]))
    assert later.text == "x stop y "


def test_holdback_keeps_only_a_possible_stop_start(make: Make, tokenizer: Any) -> None:
    detok = make(stop=["<END>"])
    detok.update(tokenizer.encode("a <E", add_special_tokens=False))
    assert detok.next_output_text(finished=False, delta=True) == "a "
    detok.update(tokenizer.encode("x", add_special_tokens=False))
    assert detok.next_output_text(finished=False, delta=True) == "<Ex"
    detok.update(tokenizer.encode(" <", add_special_tokens=False))
    assert detok.next_output_text(finished=False, delta=True) == " "
    assert detok.next_output_text(finished=True, delta=True) == "<"


def test_after_a_stop_nothing_more_is_decoded(make: Make, tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok = make(stop=["two"])
    assert detok.update(ids) == "two"
    assert list(detok.output_token_ids) == ids
    assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) == "two"
    assert detok.output_text == "one "
    assert detok.next_output_text(finished=True, delta=False) == "one "


def test_cumulative_view_returns_all_released_text(make: Make, tokenizer: Any) -> None:
    detok = make(stop=["zz"])
    detok.update(tokenizer.encode("ab z", add_special_tokens=False))
    assert detok.next_output_text(finished=False, delta=False) == "ab "
    detok.update(tokenizer.encode("q", add_special_tokens=False))
    assert detok.next_output_text(finished=False, delta=False) == "ab zq"
    assert detok.next_output_text(finished=True, delta=False) == "ab zq"


def test_factory_picks_the_fast_path_when_it_can(tokenizer: Any) -> None:
    assert isinstance(make_detokenizer(tokenizer, []), FastIncrementalDetokenizer)
    backend = tokenizer.backend_tokenizer
    assert isinstance(make_detokenizer(backend, []), FastIncrementalDetokenizer)
    slow = make_detokenizer(_PythonTokenizer(tokenizer), [], stop=["x"])
    assert isinstance(slow, SlowIncrementalDetokenizer)
    ids = [*tokenizer.encode("hi ", add_special_tokens=False), 2, 3, 905]
    assert stream(slow, [ids]).text == "hi <repo_name> world"


def test_metaspace_decoder_keeps_the_leading_space_from_the_prompt() -> None:
    from transformers import PreTrainedTokenizerFast

    tok = _sentencepiece_like_tokenizer()
    slow_tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    for detok in (
        FastIncrementalDetokenizer(tok, [1]),
        SlowIncrementalDetokenizer(slow_tok, [1]),
    ):
        assert single_steps(detok, [2, 3, 5, 6, 7]) == [" world", "!", "", "", "你", ""]


def test_byte_fallback_rewrite_does_not_break_the_stream() -> None:
    # "A" decodes alone, but as U+FFFD in an invalid byte run: DecodeStream raises; we go on.
    tok = _sentencepiece_like_tokenizer()
    detok = FastIncrementalDetokenizer(tok, [])
    deltas = single_steps(detok, [4, 5, 8, 2])
    assert deltas[0] == "A"
    assert deltas[-2:] == [" world", ""]


def test_detok_imports_neither_torch_nor_asyncio() -> None:
    package = Path(inlinelm.detok.__file__).parent
    for path in package.glob("*.py"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & {"torch", "asyncio"}, path.name


def _window_tokens(detok: IncrementalDetokenizer) -> list[object]:
    window = detok._window  # type: ignore[attr-defined]
    return [*window.group, *window.pending]


class _PythonTokenizer:
    """A tokenizer without a tokenizers backend: only the slow path's methods."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids

    def convert_ids_to_tokens(self, ids: int) -> str | None:
        token: str | None = self._tokenizer.convert_ids_to_tokens(ids)
        return token

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        text: str = self._tokenizer.convert_tokens_to_string(tokens)
        return text


def _sentencepiece_like_tokenizer() -> Tokenizer:
    """A Llama-style tokenizer: ▁ for spaces, byte fallback, one leading space stripped."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "<0x41>": 4, "<0xE4>": 5}
    vocab |= {"<0xBD>": 6, "<0xA0>": 7, "▁x": 8}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok
