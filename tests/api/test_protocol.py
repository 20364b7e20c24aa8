"""Request parsing without an engine: types, ranges, unsupported fields, the four prompt forms."""

from __future__ import annotations

from typing import Any

import pytest

from inlinelm.api.errors import APIError
from inlinelm.api.protocol import (
    Limits,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from inlinelm.sampling_params import OutputKind
from tests.api.helpers import LIMITS, USER, chat, refused


def test_chat_maps_every_sampling_field() -> None:
    body = chat(
        n=2,
        max_completion_tokens=7,
        min_tokens=1,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=3,
        stop="x",
        stop_token_ids=[5],
        include_stop_str_in_output=True,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        logit_bias={"17": -100},
        skip_special_tokens=False,
        stream=True,
        stream_options={"include_usage": True},
        user="me",
    )
    request = parse_chat(body, LIMITS)
    p = request.params
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (
        2,
        7,
        1,
        0.5,
        0.9,
        5,
    )
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        0.1,
        0.5,
        -0.5,
        1.2,
    )
    assert (p.seed, p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == (
        3,
        ("x",),
        (5,),
        True,
        True,
    )
    assert (p.logprobs, p.logit_bias, p.skip_special_tokens) == (2, {17: -100.0}, False)
    assert p.output_kind is OutputKind.DELTA
    assert request.stream and request.include_usage and request.logprobs and request.user == "me"


def test_chat_defaults_leave_sampling_to_the_engine_and_want_the_final_output_only() -> None:
    request = parse_chat(chat(), LIMITS)
    # NOTE: unset, not None (None runs to the context end): the engine gives it
    # default_max_tokens, and the model's sampling defaults to the others.
    assert request.params.unset_fields == {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
    }
    assert request.params.logprobs is None
    assert request.params.output_kind is OutputKind.FINAL_ONLY
    assert not request.stream and not request.include_usage


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat(chat(max_tokens=3, max_completion_tokens=9), LIMITS).params.max_tokens == 9
    assert parse_chat(chat(max_tokens=3), LIMITS).params.max_tokens == 3


def test_null_means_default() -> None:
    request = parse_chat(chat(temperature=None, tools=None, n=None, stop=None), LIMITS)
    assert "temperature" in request.params.unset_fields and request.params.n == 1
    explicit = parse_chat(chat(temperature=1.0, max_tokens=5), LIMITS).params
    assert not {"temperature", "max_tokens"} & explicit.unset_fields
    assert parse_completion({"prompt": "x"}, LIMITS).params.max_tokens == 16  # OpenAI's


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 101}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": True}, "n"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": [1]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 1000}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"functions": [{}]}, "functions"),
        ({"temprature": 1}, "temprature"),
    ],
)
def test_chat_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    error = refused(chat(**fields))
    assert error.param == param
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    """Accepted, and parsed exactly as if they were absent."""
    neutral = chat(tools=[], response_format={"type": "text"}, store=False)
    assert parse_chat(neutral, LIMITS) == parse_chat(chat(), LIMITS)
    neutral = {"prompt": "x", "best_of": 1, "suffix": ""}
    assert parse_completion(neutral, LIMITS) == parse_completion({"prompt": "x"}, LIMITS)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert refused([1, 2], parse_chat).param is None


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_the_four_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert parse_completion({"prompt": prompt}, LIMITS).prompts == expected


@pytest.mark.parametrize(
    "prompt", [None, [], [[]], [1, "a"], [-1], [True], 3, [2**63], [[1], [2**64]]]
)
def test_bad_prompts_are_refused(prompt: Any) -> None:
    assert refused({"prompt": prompt}).param == "prompt"


def test_completion_defaults_and_fields() -> None:
    request = parse_completion({"prompt": "x", "logprobs": 2, "max_tokens": 3}, LIMITS)
    assert request.params.max_tokens == 3 and request.params.logprobs == 2 and request.logprobs == 2
    assert parse_completion({"prompt": "x"}, LIMITS).params.max_tokens == 16


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_completion_tokens": 3}, "max_completion_tokens"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_completion_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused({"prompt": "x", **fields}).param == param


def test_tokenize_and_detokenize_bodies() -> None:
    assert parse_tokenize({"prompt": "hi"}) == ("hi", None, True)
    assert parse_tokenize({"messages": USER}) == (None, USER, False)
    assert parse_detokenize({"tokens": [1, 2]}) == [1, 2]
    for body in ({}, {"prompt": "a", "messages": USER}):
        with pytest.raises(APIError):
            parse_tokenize(body)
    for bad in ({}, {"tokens": [-1]}, {"tokens": "x"}):
        with pytest.raises(APIError):
            parse_detokenize(bad)


def test_the_fan_out_of_prompts_times_n_is_capped() -> None:
    limits = Limits(max_fanout=8)
    assert len(parse_completion({"prompt": ["a"] * 4, "n": 2}, limits).prompts) == 4
    with pytest.raises(APIError) as info:
        parse_completion({"prompt": ["a"] * 3, "n": 3}, limits)
    assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(APIError) as info:
        parse_completion({"prompt": [[1]] * 9}, limits)
    assert info.value.param == "prompt"
    with pytest.raises(APIError) as info:
        parse_chat(chat(n=4), Limits(max_fanout=3))
    assert info.value.param == "n"


def test_how_many_choices_and_logprobs_a_request_may_ask_for_is_the_engines_rule() -> None:
    """Parsing takes any n and logprobs of the right type and sign; the engine's caps
    (``max_n``, ``max_logprobs``) refuse the rest (tests/api/test_engine_limits.py)."""
    chat_params = parse_chat(chat(n=200, logprobs=True, top_logprobs=1000), LIMITS).params
    assert (chat_params.n, chat_params.logprobs) == (200, 1000)
    assert parse_completion({"prompt": "x", "logprobs": 1000}, LIMITS).params.logprobs == 1000


@pytest.mark.parametrize("token", ["²", "١٢", "1_0", " 1", "+1", "-1", "", "9" * 5000, "9" * 30])
def test_logit_bias_keys_are_ascii_token_ids_in_range(token: str) -> None:
    assert refused(chat(logit_bias={token: 1})).param == "logit_bias"


def test_logit_bias_takes_plain_token_ids() -> None:
    assert parse_chat(chat(logit_bias={"0": 1, "49151": -2.5}), LIMITS).params.logit_bias == {
        0: 1.0,
        49151: -2.5,
    }


LONE = "a\ud800b"


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_completion, {"prompt": LONE}, "prompt"),
        (parse_completion, {"prompt": ["ok", LONE]}, "prompt"),
        (parse_completion, {"prompt": "x", "stop": [LONE]}, "stop"),
        (parse_completion, {"prompt": "x", "stop": LONE}, "stop"),
        (parse_completion, {"prompt": "x", "user": LONE}, "user"),
        (parse_chat, chat(messages=[{"role": "user", "content": LONE}]), "messages[0].content"),
        (
            parse_chat,
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
            "messages[0].content[0].text",
        ),
        (parse_chat, chat(messages=[{"role": "user", "content": "x", "name": LONE}]), None),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(
    parse: Any, body: dict[str, Any], param: str | None
) -> None:
    error = refused(body, parse)
    assert error.param == (param or "messages[0].name")


def test_a_lone_surrogate_in_tokenize_is_refused() -> None:
    for body in ({"prompt": LONE}, {"messages": [{"role": "user", "content": LONE}]}):
        with pytest.raises(APIError) as info:
            parse_tokenize(body)
        assert info.value.status == 400 and info.value.param in ("prompt", "messages[0].content")


def test_surrogate_pairs_are_text() -> None:
    assert parse_completion({"prompt": "\U0001f600"}, LIMITS).prompts == ["\U0001f600"]


def test_an_error_naming_an_unencodable_field_still_renders() -> None:
    error = refused({"prompt": "x", LONE: 1})
    assert b"\\ud800" in error.response().body


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 10**30},
        {"seed": 10**30},
        {"seed": -(10**30)},
        {"n": 10**30},
        {"top_k": 10**30},
        {"min_tokens": 10**30},
        {"stop_token_ids": [10**30]},
        {"temperature": 10**400},
        {"logit_bias": {"1": 10**400}},
        {"logprobs": 10**30},
    ],
)
def test_huge_integers_are_400s(fields: dict[str, Any]) -> None:
    refused({"prompt": "x", **fields})
