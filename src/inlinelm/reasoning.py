"""Reasoning models' text → the reasoning and the answer, one parser per family, chosen by
name (a registry beside the tool parsers).

Reasoning models think inside ``<think>…</think>`` before they answer:

- ``deepseek_r1``: DeepSeek-R1 and its distills. Their chat templates open the tag in the
  generation prompt, so the output starts inside the reasoning (a model that writes the
  opening tag itself is read the same way); everything up to ``</think>`` is reasoning,
  and an answer cut before the closing tag is all reasoning.
- ``qwen3``: Qwen3 thinks only when it writes ``<think>`` first; with
  ``enable_thinking=false`` its template closes an empty block in the prompt and the output
  is all answer. An output that opened the tag and was cut before closing it is all
  reasoning.
- :class:`TagReasoningParser` configured with any two tags (and whether the prompt opens
  the first) covers the other families.

:func:`parser_for_template` picks a parser from a model's chat template. The split is on
text, so a tag that straddles tokens is found whole, and no tag text goes
into either part. The answer's leading whitespace (the blank line models write after
``</think>``) is dropped; an empty part is None.

:meth:`ReasoningParser.split` reads a whole output; :meth:`ReasoningParser.stream` returns
a :class:`ReasoningStream` that splits the deltas of a streamed one, holding back only text
that may still become a tag, so that its deltas add up to :meth:`~ReasoningParser.split`'s
parts exactly, however the text was cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from inlinelm.errors import RequestError
from inlinelm.tools.parsers import partial_suffix, registered

_UNDECIDED = "undecided"  # whether the output opens the reasoning is not known yet
REASONING = "reasoning"
ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """A whole output's reasoning and answer (None where empty)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True, slots=True)
class TagReasoningParser:
    """Reasoning between ``start_tag`` and ``end_tag`` at the start of an output.

    ``opened_by_prompt``: the chat template opens ``start_tag`` in the generation prompt,
    so the output starts inside the reasoning; else an output that does not start with
    ``start_tag`` (after whitespace) is all answer.
    """

    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    opened_by_prompt: bool = False

    def __post_init__(self) -> None:
        if not self.start_tag or not self.end_tag:
            raise ValueError("a reasoning parser needs two non-empty tags")

    def split(self, text: str) -> ReasoningSplit:
        """The reasoning and the answer of a whole output."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return ReasoningSplit(
            (reasoning + more_reasoning) or None, (content + more_content) or None
        )

    def stream(self) -> ReasoningStream:
        """A splitter for one streamed output."""
        return ReasoningStream(self)


class ReasoningStream:
    """Splits one output's deltas into reasoning and answer deltas (see the module
    docstring); :meth:`feed` each delta, then :meth:`finish` once."""

    def __init__(self, parser: TagReasoningParser) -> None:
        self._parser = parser
        self._state = REASONING if parser.opened_by_prompt else _UNDECIDED
        # NOTE: opened by the prompt, the model may still write the opening tag itself
        self._may_open = True
        self._answer_started = False
        self._held = ""
        self._fed = 0  # characters fed so far
        # (tokens, characters) per engine step while the reasoning may go on; then the count
        self._marks: list[tuple[int, int]] | None = []
        self._num_reasoning_tokens = 0

    def feed(self, delta: str) -> tuple[str, str]:
        """This delta's (reasoning, answer) text: either may be empty."""
        self._held += delta
        self._fed += len(delta)
        if self._may_open and not self._read_opening():
            return "", ""
        reasoning = ""
        if self._state == REASONING:
            reasoning, closed = self._read_reasoning()
            if not closed:
                return reasoning, ""
        return reasoning, self._read_answer()

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended: a partial tag is plain text of
        the part it was in."""
        held, self._held = self._held, ""
        if self._state == _UNDECIDED:
            return "", held.lstrip()
        if self._state == REASONING:
            return held, ""
        return "", held if self._answer_started else held.lstrip()

    def mark(self, num_tokens: int, num_chars: int) -> None:
        """Note that the output's first ``num_tokens`` tokens decode to ``num_chars``
        characters (once per engine step, before the text is fed): what
        :meth:`reasoning_tokens` counts by. Kept only while the reasoning may go on."""
        if self._marks is not None:
            self._marks.append((num_tokens, num_chars))

    def reasoning_tokens(self, num_tokens: int) -> int:
        """How many of the output's ``num_tokens`` tokens are reasoning, its tags included:
        those up to the one that completes the closing tag; all of them while the
        reasoning is open; none for an output that is all answer."""
        if self._state == REASONING:
            return num_tokens
        return self._num_reasoning_tokens

    def _count_until(self, closed_at: int) -> None:
        """The reasoning ended at character ``closed_at``: count its tokens by the marks."""
        marks, self._marks = self._marks or [], None
        self._num_reasoning_tokens = next(
            (tokens for tokens, chars in marks if chars >= closed_at),
            marks[-1][0] if marks else 0,
        )

    def _read_opening(self) -> bool:
        """Decide from the held text whether the output opens with the reasoning tag;
        False while whitespace or a prefix of the tag cannot tell yet."""
        tag = self._parser.start_tag
        body = self._held.lstrip()
        if not body or (len(body) < len(tag) and tag.startswith(body)):
            return False
        self._may_open = False
        if body.startswith(tag):
            self._held = body[len(tag) :]
            self._state = REASONING
        elif self._state == _UNDECIDED:
            self._state = ANSWER
            self._marks = None
        return True

    def _read_reasoning(self) -> tuple[str, bool]:
        """Reasoning text up to the closing tag (or up to what may begin one), and whether
        the tag was found."""
        tag = self._parser.end_tag
        at = self._held.find(tag)
        if at >= 0:
            part, self._held = self._held[:at], self._held[at + len(tag) :]
            self._state = ANSWER
            self._count_until(self._fed - len(self._held))
            return part, True
        keep = partial_suffix(self._held, tag)
        part, self._held = self._held[:keep], self._held[keep:]
        return part, False

    def _read_answer(self) -> str:
        """Answer text, its leading whitespace held until other text shows (then dropped)."""
        if not self._answer_started:
            body = self._held.lstrip()
            if not body:
                return ""
            self._answer_started = True
            self._held = body
        out, self._held = self._held, ""
        return out


ReasoningParser = TagReasoningParser

PARSERS: Mapping[str, ReasoningParser] = {
    parser.name: parser
    for parser in (
        TagReasoningParser("deepseek_r1", opened_by_prompt=True),
        TagReasoningParser("qwen3"),
    )
}


def parser_for_template(template: str, generation_prompt: str) -> ReasoningParser | None:
    """The parser a chat template's family takes: none for a template that knows no
    ``<think>``; ``deepseek_r1`` when its generation prompt (``generation_prompt``: a turn
    rendered with ``add_generation_prompt``) ends by opening the tag; ``qwen3`` (thinking
    only where the output opens it) otherwise."""
    if "<think>" not in template:
        return None
    if generation_prompt.rstrip().endswith("<think>"):
        return PARSERS["deepseek_r1"]
    return PARSERS["qwen3"]


def reasoning_choice(value: str | ReasoningParser | None) -> ReasoningParser | str | None:
    """A chat's ``reasoning_parser`` as a submission takes it: None (the engine's),
    ``"none"``, or a parser (a name looked up; an unknown one is a ``RequestError``)."""
    if not isinstance(value, str) or value == "none":
        return value
    parser = PARSERS.get(value)
    if parser is None:
        known = ", ".join(["none", *PARSERS])
        raise RequestError(
            f"unknown reasoning parser {value!r}; known: {known}", param="reasoning_parser"
        )
    return parser


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name`` (``ValueError`` naming the known ones otherwise)."""
    return registered(PARSERS, name, "reasoning parser")
