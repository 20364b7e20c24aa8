"""``python -m inlinelm.docs``: the README's tables rendered from the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from inlinelm.cli_options import ENGINE_HELP
from inlinelm.config import EngineConfig
from inlinelm.docs import (
    BLOCKS,
    engine_options_table,
    main,
    marked_block,
    render_blocks,
    server_options_table,
)

STALE = "intro\n<!-- options:start -->\nold\n<!-- options:end -->\nmiddle\n" + (
    "<!-- server-options:start --><!-- server-options:end -->\n"
    "<!-- architectures:start -->\nold\n<!-- architectures:end -->\nend\n"
)


def test_the_engine_table_has_one_row_per_field_with_its_default_and_help() -> None:
    rows = engine_options_table().splitlines()[2:]
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{name}`" for name in names]
    assert '| `model` | `"default"` |' in rows[0] and rows[0].endswith(f"{ENGINE_HELP['model']} |")
    assert any("`536870912` (512 MiB)" in row for row in rows)


def test_the_server_table_lists_the_flags_with_their_defaults() -> None:
    table = server_options_table()
    assert "| `--port` | `8000` | port to listen on |" in table
    assert '| `--log-level` | `"info"` | log level: debug, info, warning, error |' in table
    assert "`--api-key`" in table and "%(default)" not in table


def test_render_fills_every_marked_block_and_keeps_the_rest() -> None:
    text = render_blocks(STALE)
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("end\n")
    for name, render in BLOCKS.items():
        assert marked_block(text, name) == render()
    assert render_blocks(text) == text


def test_a_missing_block_is_an_error() -> None:
    with pytest.raises(ValueError, match="server-options"):
        render_blocks("<!-- options:start --><!-- options:end -->")
    assert marked_block("no markers", "options") is None


def test_readme_command_checks_then_rewrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "README.md"
    path.write_text(STALE, encoding="utf-8")
    assert main(["readme", str(path), "--check"]) == 1
    assert "python -m inlinelm.docs readme" in capsys.readouterr().out
    assert path.read_text(encoding="utf-8") == STALE
    assert main(["readme", str(path)]) == 0
    assert main(["readme", str(path), "--check"]) == 0
    assert main(["options"]) == 0
    assert capsys.readouterr().out == engine_options_table() + "\n"
    assert main(["architectures"]) == 0
    table = capsys.readouterr().out
    assert "| Gemma 2 | `gemma2` |" in table and table.strip() in path.read_text()
