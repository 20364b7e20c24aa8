"""Every tool-call parser by name, and the one a chat template's format takes."""

from __future__ import annotations

from collections.abc import Mapping

from inlinelm.tools.family_parsers import MistralParser, PythonicParser, Qwen3CoderParser
from inlinelm.tools.parsers import HermesParser, Llama3JsonParser, ToolParser, registered

PARSERS: Mapping[str, ToolParser] = {
    parser.name: parser
    for parser in (
        HermesParser(),
        Llama3JsonParser(),
        Qwen3CoderParser(),
        MistralParser(),
        PythonicParser(),
    )
}


def get_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (``ValueError`` naming the known ones otherwise)."""
    return registered(PARSERS, name, "tool-call parser")


def parser_for_template(template: str | None) -> ToolParser:
    """The parser for the format a chat template teaches: Qwen3-Coder's XML where it
    writes ``<function=`` and ``<parameter=``; Mistral's where it knows ``[TOOL_CALLS]``;
    pythonic calls where it opens ``<|python_start|>`` (Llama 4) or shows
    ``func_name1(`` (Llama 3.2's pythonic template); Llama 3's JSON where it holds
    ``<|python_tag|>`` or asks for ``"parameters"`` without ``<tool_call>`` tags;
    otherwise ``hermes`` (also what templates without tools are taught)."""
    text = template or ""
    if "<function=" in text and "<parameter=" in text:
        return PARSERS["qwen3_coder"]
    if MistralParser.marker in text:
        return PARSERS["mistral"]
    if PythonicParser.start_tag in text or "func_name1(" in text:
        return PARSERS["pythonic"]
    if "<tool_call>" not in text and (
        Llama3JsonParser.python_tag in text or '"parameters"' in text
    ):
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
