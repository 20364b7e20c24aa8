"""The tool policy of chats: what a chat that offers tools hands the chat template, and its
choices, with the model's text read for tool calls.

:class:`ToolPolicy` decides both: the messages and tools the template gets (natively when
the template takes tools, written into the messages otherwise), and the parser that reads
an answer (the forced call's own, the server's, or the one the template's family uses).

A whole answer is parsed once. A stream sends content as usual until text that may be a
call appears (the parser's :meth:`~inlinelm.tools.ToolParser.hold_from`); from there it
holds the text back until the choice ends, then sends either the calls, in one chunk the
way the openai SDK accumulates them (each with ``index``, ``id``, ``type`` and the whole
``function``), with ``finish_reason`` "tool_calls", or the held text as content with the
engine's own finish reason when it was no call after all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inlinelm.api.formats import ChatFormat, ChoiceFormat
from inlinelm.api.protocol import ChatRequest
from inlinelm.api.responses import TokenTexts, chat_choice, chat_delta_choice, chat_logprobs
from inlinelm.runtime.outputs import CompletionOutput, TokenLogprobs
from inlinelm.sampling_params import SamplingParams
from inlinelm.tools.calls import ParsedOutput, ToolCall
from inlinelm.tools.forced import ForcedCallParser, ForcedHermesParser, hermes_forced_structure
from inlinelm.tools.parsers import ToolParser
from inlinelm.tools.registry import parser_for_template
from inlinelm.tools.template import prepare_messages, template_supports_tools


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How one served model's chats use tools. ``parser``: the server's parser for
    ``tool_choice`` "auto" (None: the one the chat template's family uses); ``template``:
    the model's chat template source, read only by a chat that offers tools or holds tool
    turns."""

    parser: ToolParser | None
    template: Callable[[], str]

    def inputs(
        self, parsed: ChatRequest
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools for the chat template (see :mod:`inlinelm.tools.template`)."""
        offered = parsed.tools.offered if parsed.tools is not None else []
        has_tool_turns = any(m["role"] == "tool" or "tool_calls" in m for m in parsed.messages)
        if not offered and not has_tool_turns:
            return parsed.messages, None
        native = template_supports_tools(self.template())
        messages = prepare_messages(parsed.messages, offered, native=native)
        tools = [t.to_openai() for t in offered] if native and offered else None
        return messages, tools

    def params(self, parsed: ChatRequest) -> SamplingParams:
        """The chat's sampling parameters: "required" for a model of Hermes' format is
        forced in ``<tool_call>`` blocks (:func:`~inlinelm.tools.hermes_forced_structure`)
        rather than the JSON the request was parsed with."""
        tools = parsed.tools
        if tools is None or not self._forced_as_hermes(parsed):
            return parsed.params
        return parsed.params.with_overrides(
            structured=hermes_forced_structure(tools.tools, tools.parallel)
        )

    def family_parser(self) -> ToolParser:
        """The parser of "auto" answers: the server's, else the chat template's family's."""
        return self.parser or parser_for_template(self.template())

    def _forced_as_hermes(self, parsed: ChatRequest) -> bool:
        tools = parsed.tools
        return (
            tools is not None
            and tools.choice == "required"
            and self.family_parser().name == "hermes"
        )

    def format(self, parsed: ChatRequest, texts: TokenTexts) -> ChoiceFormat:
        """Plain chat choices, or choices read for tool calls when the chat offers tools."""
        tools = parsed.tools
        if tools is None or tools.choice == "none":
            return ChatFormat(texts, parsed.logprobs)
        parser: ToolParser
        if self._forced_as_hermes(parsed):
            parser = ForcedHermesParser(tools.tools)
        elif tools.forced:
            parser = ForcedCallParser(tools.tools, tools.named)
        else:
            parser = self.family_parser()
            with_tools = getattr(parser, "with_tools", None)
            if with_tools is not None:
                parser = with_tools(tools.offered)  # NOTE: one that types values by schema
        names = frozenset(tool.name for tool in tools.offered)
        return ToolChatFormat(texts, parsed.logprobs, parser, tools.parallel, names)


@dataclass(slots=True)
class _Held:
    """One streamed choice: its text so far, how much of it was sent, unsent logprobs."""

    text: str = ""
    sent: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class ToolChatFormat:
    """``chat.completion(.chunk)`` choices that may carry ``tool_calls`` (see the module
    docstring). ``parallel`` false keeps only the first call an answer holds. ``names``:
    the functions offered; a call to any other is dropped (an answer left with no call is
    plain content)."""

    texts: TokenTexts
    logprobs: bool
    parser: ToolParser
    parallel: bool = True
    names: frozenset[str] | None = None
    chunk_object: str = "chat.completion.chunk"
    response_object: str = "chat.completion"
    _held: dict[int, _Held] = field(default_factory=dict)

    def opening(self, index: int) -> dict[str, Any] | None:
        return chat_delta_choice(index, {"role": "assistant", "content": ""})

    def delta(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        reason: str | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any] | None:
        held = self._held.setdefault(index, _Held())
        held.text += text
        held.logprobs += logprobs or []
        if reason is not None:
            return self._close(index, reason)
        end = self.parser.hold_from(held.text)
        if end <= held.sent:
            return None
        content, held.sent = held.text[held.sent : end], end
        return chat_delta_choice(index, {"content": content}, None, self._take_logprobs(held))

    def finish(
        self, index: int, reason: str, logprobs: list[TokenLogprobs] | None
    ) -> dict[str, Any]:
        self._held.setdefault(index, _Held()).logprobs += logprobs or []
        return self._close(index, reason)

    def whole(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        logprobs = self._logprobs(output.logprobs)
        parsed = self._parse(output.text)
        if parsed is None:
            return chat_choice(index, output.text, output.finish_reason, logprobs)
        message = {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": [call.to_openai() for call in parsed.calls],
        }
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": "tool_calls",
        }

    def _close(self, index: int, reason: str) -> dict[str, Any]:
        """The choice's last chunk: the held text as calls, or as content."""
        held = self._held.pop(index, _Held())
        tail = held.text[held.sent :]
        logprobs = self._take_logprobs(held)
        parsed = self._parse(tail) if tail else None
        if parsed is None:
            return chat_delta_choice(index, {"content": tail} if tail else {}, reason, logprobs)
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        delta["tool_calls"] = [call.to_openai(i) for i, call in enumerate(parsed.calls)]
        return chat_delta_choice(index, delta, "tool_calls", logprobs)

    def _parse(self, text: str) -> ParsedOutput | None:
        parsed = self.parser.parse(text)
        if parsed is None:
            return None
        calls: list[ToolCall] = [
            call for call in parsed.calls if self.names is None or call.name in self.names
        ]
        if not calls:
            return None
        calls = calls if self.parallel else calls[:1]
        return ParsedOutput(parsed.content, calls)

    def _take_logprobs(self, held: _Held) -> dict[str, Any] | None:
        entries, held.logprobs = held.logprobs, []
        return self._logprobs(entries)

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(entries or [], self.texts)
