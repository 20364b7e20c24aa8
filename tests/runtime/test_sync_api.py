"""The sync API matches the async one: ``generate`` takes keyword overrides like ``stream``,
``generate_chat`` answers conversations, progress bars fit Jupyter, and a load error is
raised without a chained "no running event loop"."""

from __future__ import annotations

import io
import sys
import traceback
from pathlib import Path

import pytest

from inlinelm import Engine, ModelLoadError
from inlinelm.progress import progress_bar
from tests.runtime.helpers import echo_engine, echo_text, run

CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]

# What a Jupyter kernel's sys.stderr looks like to us: ipykernel's OutStream.
KernelStream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_takes_keyword_overrides_like_stream() -> None:
    engine = echo_engine()
    try:
        outs = engine.generate(["one", "two"], max_tokens=3, ignore_eos=True, use_tqdm=False)
        assert [len(out.token_ids) for out in outs] == [3, 3]
        single = engine.generate("three", max_tokens=2, ignore_eos=True, use_tqdm=False)
        assert len(single) == 1 and len(single[0].token_ids) == 2
    finally:
        engine.close()


def test_generate_chat_answers_one_conversation_or_many() -> None:
    engine = echo_engine()
    try:
        one = engine.generate_chat(CONVERSATION, max_tokens=None, use_tqdm=False)

        async def answer() -> str:
            return (await engine.chat(CONVERSATION, max_tokens=None)).text

        expected = run(answer())
        assert len(one) == 1 and one[0].text == expected and "France" not in expected
        other = [{"role": "user", "content": "And of Spain?"}]
        many = engine.generate_chat([CONVERSATION, other], max_tokens=None, use_tqdm=False)
        assert [out.text for out in many] == [expected, expected]  # the echo stops at EOS
    finally:
        engine.close()


def test_generate_in_jupyter_without_ipywidgets_draws_the_plain_bar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE: warnings are errors here, so tqdm.auto's "IProgress not found" would fail this.
    stream = KernelStream()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # not installed
    engine = echo_engine()
    try:
        outs = engine.generate(["in a notebook"], max_tokens=None)
        assert outs[0].text == echo_text(engine, "in a notebook")
    finally:
        engine.close()
    assert "generate: 100%" in stream.getvalue()


def test_bars_show_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for stream, shown in ((TerminalStream(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(2, "work") as bar:
            bar.update(2)
        assert ("work: 100%" in stream.getvalue()) is shown


def test_a_first_start_shows_weight_loading_progress_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    stream = TerminalStream()
    monkeypatch.setattr(sys, "stderr", stream)
    engine = Engine(model=str(tiny_model_dir), num_threads=1, max_num_seqs=2)
    try:
        engine.start_sync()
    finally:
        engine.close()
    assert f"loading {tiny_model_dir.name} weights: 100%" in stream.getvalue()


def test_a_load_error_from_generate_has_no_event_loop_chained(tmp_path: Path) -> None:
    engine = Engine(model=str(tmp_path / "nope"))
    try:
        with pytest.raises(ModelLoadError, match="does not exist") as info:
            engine.generate("hello", use_tqdm=False)
    finally:
        engine.close()
    text = "".join(traceback.format_exception(info.value))
    assert "no running event loop" not in text
    assert info.value.__context__ is None and info.value.__cause__ is None
