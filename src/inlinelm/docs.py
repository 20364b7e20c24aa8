"""Documentation rendered from the code: the README's options tables.

The engine options table comes from :class:`~inlinelm.EngineConfig`'s fields (name,
default) and the CLI's ``ENGINE_HELP`` (meaning); the server flags table from the
``inlinelm serve`` parser. README.md holds each between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` markers, and a test fails when they differ from what the code renders.

``python -m inlinelm.docs options`` prints the engine options table,
``python -m inlinelm.docs server-options`` the server flags table, and
``python -m inlinelm.docs readme [PATH] [--check]`` rewrites the marked blocks of PATH
(default: README.md) in place, or with ``--check`` exits 1 when they are stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inlinelm.cli_options import ENGINE_HELP, add_server_options
from inlinelm.config import EngineConfig

MIB = 1024**2


def engine_options_table() -> str:
    """A markdown table of every ``EngineConfig`` field: name, default, meaning."""
    defaults = EngineConfig()
    rows = [
        (f"`{f.name}`", _default_cell(f.name, getattr(defaults, f.name)), _help_for(f.name))
        for f in dataclasses.fields(EngineConfig)
    ]
    return _table(("option", "default", "meaning"), rows)


def server_options_table() -> str:
    """A markdown table of ``inlinelm serve``'s server flags: flag, default, meaning."""
    parser = argparse.ArgumentParser(add_help=False)
    add_server_options(parser)
    rows = []
    # NOTE: argparse has no public way to list a parser's actions; _actions is stable.
    for action in parser._actions:
        flag = max(action.option_strings, key=len)
        rows.append((f"`{flag}`", _default_cell(action.dest, action.default), _flag_help(action)))
    return _table(("flag", "default", "meaning"), rows)


def architectures_table() -> str:
    """A markdown table of the model families we run (see
    :func:`inlinelm.gpu.model.registry.architecture_table`)."""
    # NOTE: imported here: the registry imports torch, which the options tables do not need.
    from inlinelm.gpu.model.registry import architecture_table

    return architecture_table().strip()


BLOCKS: dict[str, Callable[[], str]] = {
    "options": engine_options_table,
    "server-options": server_options_table,
    "architectures": architectures_table,
}
"""Each marked README block and the function that renders it."""


def render_blocks(text: str) -> str:
    """``text`` with every marked block (see :data:`BLOCKS`) replaced by a fresh rendering."""
    for name, render in BLOCKS.items():
        pattern = _block_pattern(name)
        if pattern.search(text) is None:
            raise ValueError(f"no <!-- {name}:start --> ... <!-- {name}:end --> block")
        table = render()

        def fill(match: re.Match[str], table: str = table) -> str:
            return f"{match['start']}\n{table}\n{match['end']}"

        text = pattern.sub(fill, text)
    return text


def marked_block(text: str, name: str) -> str | None:
    """The text between ``name``'s markers in ``text`` (stripped), or None without markers."""
    match = _block_pattern(name).search(text)
    return None if match is None else match["body"].strip()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inlinelm.docs``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m inlinelm.docs", description=__doc__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser("options", help="print the engine options table")
    commands.add_parser("server-options", help="print the server flags table")
    commands.add_parser("architectures", help="print the supported architectures table")
    readme = commands.add_parser("readme", help="rewrite the README's generated tables")
    readme.add_argument("path", nargs="?", default="README.md")
    readme.add_argument("--check", action="store_true", help="exit 1 when the tables are stale")
    args = parser.parse_args(argv)
    if args.command in BLOCKS:
        print(BLOCKS[args.command]())
        return 0
    path = Path(args.path)
    old = path.read_text(encoding="utf-8")
    new = render_blocks(old)
    if args.check:
        if new != old:
            print(f"{path}: stale tables; run: python -m inlinelm.docs readme {path}")
            return 1
        return 0
    if new != old:
        path.write_text(new, encoding="utf-8")
    return 0


def _block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(?P<start><!-- {re.escape(name)}:start -->)(?P<body>.*?)(?P<end><!-- {re.escape(name)}:end -->)",
        re.DOTALL,
    )


def _help_for(name: str) -> str:
    return ENGINE_HELP.get(name, f"engine option {name}")


def _flag_help(action: argparse.Action) -> str:
    """The flag's help without its ``(default: …)`` note when that only repeats the default."""
    text = (action.help or "").replace(" (default: %(default)s)", "")
    if action.choices is not None:
        text += ": " + ", ".join(str(choice) for choice in action.choices)
    return text % {"default": action.default}


def _default_cell(name: str, value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if name.endswith("_bytes") and isinstance(value, int) and value and value % MIB == 0:
        return f"`{value}` ({value // MIB} MiB)"
    return f"`{value!r}`"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
