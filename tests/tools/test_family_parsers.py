"""The newer families' tool-call formats: Qwen3-Coder's XML, Mistral's ``[TOOL_CALLS]`` (both
of its forms) and pythonic calls; what each reads, refuses, holds back while streaming,
and which chat templates pick them."""

from __future__ import annotations

import json

import pytest

from inlinelm.tools import MistralParser, PythonicParser, Qwen3CoderParser, parser_for_template
from inlinelm.tools.calls import ParsedOutput

QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    '<parameter=days>\n3\n</parameter>\n<parameter=units>\n["c", "f"]\n</parameter>\n'
    "</function>\n</tool_call>"
)


def _calls(parsed: ParsedOutput | None) -> list[tuple[str, dict[str, object]]]:
    assert parsed is not None
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_qwen3_coder_reads_typed_parameters_and_keeps_the_text_around_calls() -> None:
    text = f"Let me look.\n{QWEN3_CODER_CALL}\n{QWEN3_CODER_CALL}\nDone."
    parsed = Qwen3CoderParser().parse(text)
    expected = ("get_weather", {"city": "San Francisco", "days": 3, "units": ["c", "f"]})
    assert _calls(parsed) == [expected, expected]
    assert parsed is not None and parsed.content == "Let me look.\nDone."


def test_qwen3_coder_reads_a_bare_function_and_one_cut_short() -> None:
    bare = "<function=f>\n<parameter=a>\nx y\n</parameter>\n</function>"
    assert _calls(Qwen3CoderParser().parse(bare)) == [("f", {"a": "x y"})]
    cut = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"
    assert _calls(Qwen3CoderParser().parse(cut)) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    ["A plain answer.", '<tool_call>\n{"name": "f"}\n</tool_call>', "<tool_call></tool_call>"],
)
def test_qwen3_coder_text_without_wellformed_calls_is_a_plain_answer(text: str) -> None:
    assert Qwen3CoderParser().parse(text) is None


@pytest.mark.parametrize(
    ("text", "hold"),
    [("Sure", 4), ("Sure <tool", 5), ("Sure <func", 5), ("a <tool_call>\n<function=f>", 2)],
)
def test_qwen3_coder_holds_text_from_a_possible_call(text: str, hold: int) -> None:
    assert Qwen3CoderParser().hold_from(text) == hold


def test_mistral_reads_its_json_list_and_its_args_form() -> None:
    v3 = 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    parsed = MistralParser().parse(v3)
    assert _calls(parsed) == [("f", {"a": 1}), ("g", {})]
    assert parsed is not None and parsed.content == "Checking."
    v11 = '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}'
    assert _calls(MistralParser().parse(v11)) == [("f", {"a": 1}), ("g", {})]


@pytest.mark.parametrize(
    "text",
    ["No calls.", "[TOOL_CALLS]not json", '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS][]"],
)
def test_mistral_text_without_wellformed_calls_is_a_plain_answer(text: str) -> None:
    assert MistralParser().parse(text) is None


@pytest.mark.parametrize(("text", "hold"), [("Hi", 2), ("Hi [TOOL", 3), ("Hi [TOOL_CALLS][", 3)])
def test_mistral_holds_text_from_a_possible_marker(text: str, hold: int) -> None:
    assert MistralParser().hold_from(text) == hold


def test_pythonic_reads_literal_keyword_calls_never_evaluating_them() -> None:
    text = '[get_weather(city="Paris", days=3, units=["c"]), tools.now(), flag(on=True, x=None)]'
    assert _calls(PythonicParser().parse(text)) == [
        ("get_weather", {"city": "Paris", "days": 3, "units": ["c"]}),
        ("tools.now", {}),
        ("flag", {"on": True, "x": None}),
    ]
    wrapped = "<|python_start|>[f(a=1)]<|python_end|>"
    assert _calls(PythonicParser().parse(wrapped)) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "[]",
        "[f(1)]",
        "[f(a=__import__('os').system('true'))]",
        "[f(**kw)]",
        "[f(a=1)",
        "[f(a={1, 2})]",
        "[1, 2]",
    ],
)
def test_pythonic_anything_but_literal_calls_is_a_plain_answer(text: str) -> None:
    assert PythonicParser().parse(text) is None


@pytest.mark.parametrize(("text", "hold"), [("", 0), ("  [f(", 0), ("<|python", 0), ("Sure", 4)])
def test_pythonic_holds_an_answer_that_starts_like_calls(text: str, hold: int) -> None:
    assert PythonicParser().hold_from(text) == hold


def test_templates_pick_the_new_families() -> None:
    coder = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    assert parser_for_template(coder).name == "qwen3_coder"
    assert parser_for_template("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}").name == "mistral"
    llama4 = "{{- '<|python_start|>' }}"
    assert parser_for_template(llama4).name == "pythonic"
    llama32 = "[func_name1(params_name1=params_value1, params_name2=params_value2...)]"
    assert parser_for_template(llama32).name == "pythonic"


def test_qwen3_coder_keeps_a_string_parameter_as_written_when_it_knows_the_schema() -> None:
    from inlinelm.tools import FunctionTool

    schema = {"type": "object", "properties": {"zip": {"type": "string"}, "n": {"type": "integer"}}}
    text = "<function=f>\n<parameter=zip>\n12345\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>"
    assert _calls(Qwen3CoderParser().parse(text)) == [("f", {"zip": 12345, "n": 3})]
    typed = Qwen3CoderParser().with_tools([FunctionTool("f", parameters=schema)])
    assert _calls(typed.parse(text)) == [("f", {"zip": "12345", "n": 3})]
