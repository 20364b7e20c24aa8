"""Requests of the OpenAI-compatible API, parsed from JSON into typed records.

Parsing happens before anything reaches the engine: a bad body, a field of the wrong type,
an out-of-range value or a field inlinelm does not implement is a 400 (:class:`APIError`)
naming the field. Range checks live in :class:`~inlinelm.SamplingParams`, whose
``RequestError`` is turned into the same 400 here, and the engine's caps on one request
(``n``, ``logprobs``, stop strings: ``EngineConfig.max_n``, ``max_logprobs``, …) in the
engine, which refuses a request past them before queueing it: each rule is written once.
A chat's engine errors name the chat's own field (:data:`CHAT_PARAMS`).

Sampling fields a body leaves out (or sends as ``null``) stay unset, so the engine gives
them its defaults: the model's generation_config.json and the ``default_*`` engine options
(a chat without ``max_tokens`` gets ``default_max_tokens``). A completions body without
``max_tokens`` gets OpenAI's 16.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inlinelm.api.constraints import read_constraint
from inlinelm.api.errors import bad_request
from inlinelm.api.fields import INT_MAX, Fields, check_text
from inlinelm.api.messages import read_messages
from inlinelm.api.tool_request import ToolRequest, read_tools
from inlinelm.chat_template import template_kwargs_error
from inlinelm.errors import RequestError
from inlinelm.runtime.prompt_source import Prompt
from inlinelm.sampling_params import UNSET, OutputKind, SamplingParams
from inlinelm.structured.spec import StructuredOutput
from inlinelm.tools.forced import forced_structure

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_FANOUT = 256

CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}
"""The chat field each engine parameter stands for, where their names differ: an engine
error about ``logprobs`` is, to a chat's client, about ``top_logprobs``."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-side limits a request is checked against before it reaches the engine.

    ``max_fanout`` bounds the engine requests one HTTP request becomes: prompts × ``n``
    (how large ``n`` itself may be is the engine's ``max_n``).
    """

    max_fanout: int = DEFAULT_MAX_FANOUT


@dataclass(slots=True)
class ChatRequest:
    """A parsed ``POST /v1/chat/completions`` body; ``tools`` is None when it offers none."""

    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    user: str | None
    tools: ToolRequest | None = None
    include_reasoning: bool = True
    # The chat template's variables: chat_template_kwargs, and reasoning_effort under
    # that name (for templates that read it).
    template_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class CompletionRequest:
    """A parsed ``POST /v1/completions`` body; ``prompts`` has one entry per prompt."""

    model: str | None
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    user: str | None
    # vLLM's prompt_logprobs field was given: each choice shows them
    show_prompt_logprobs: bool = False


def parse_chat(data: Any, limits: Limits) -> ChatRequest:
    """Parse a chat completions body (see the module docstring for the error contract)."""
    fields = Fields(data)
    messages = read_messages(fields)
    logprobs = fields.read_bool("logprobs", False)
    top_logprobs = fields.read_int("top_logprobs", None)
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = _read_chat_max_tokens(fields)
    stream, include_usage = _read_stream(fields)
    options = _read_sampling(fields, max_tokens=max_tokens, stream=stream)
    _check_fanout(1, options["n"], limits)
    if logprobs:
        options["logprobs"] = top_logprobs or 0
    tools = read_tools(fields)
    options["structured"] = _chat_constraint(fields, tools)
    request = ChatRequest(
        model=fields.read_str("model", None),
        messages=messages,
        params=_sampling_params(options, CHAT_PARAMS),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        user=fields.read_str("user", None),
        tools=tools,
        include_reasoning=fields.read_bool("include_reasoning", True),
        template_kwargs=_read_template_kwargs(fields),
    )
    fields.refuse_rest()
    return request


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _read_template_kwargs(fields: Fields) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (an object of template variables), with ``reasoning_effort``
    added as the variable of that name unless the object sets it."""
    kwargs = fields.raw("chat_template_kwargs")
    if kwargs is not None:
        why = template_kwargs_error(kwargs)
        if why is not None:
            raise bad_request(f"chat_template_kwargs {why}", "chat_template_kwargs")
    effort = fields.read_str("reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                "reasoning_effort",
            )
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    return None if kwargs is None else dict(kwargs)


def _chat_constraint(fields: Fields, tools: ToolRequest | None) -> StructuredOutput | None:
    """The output constraint: the request's own, or the tool-call schema when the tool
    choice forces a call (both at once is a 400)."""
    constraint, field = read_constraint(fields)
    if tools is None or not tools.forced:
        return constraint
    if constraint is not None:
        raise bad_request(
            f"{field} cannot be combined with a tool_choice that forces a call "
            "(the call's arguments already follow the function's parameters)",
            field,
        )
    try:
        return forced_structure(tools.tools, tools.named, tools.parallel)
    except RequestError as exc:
        raise bad_request(f"tools: {exc.message}", "tools") from None


def parse_completion(data: Any, limits: Limits) -> CompletionRequest:
    """Parse a completions body (see the module docstring for the error contract)."""
    fields = Fields(data)
    prompts = _read_prompts(fields)
    logprobs = fields.read_int("logprobs", None)
    echo = fields.read_bool("echo", False)
    prompt_logprobs = fields.read_int("prompt_logprobs", None)
    stream, include_usage = _read_stream(fields)
    options = _read_sampling(fields, max_tokens=fields.read_int("max_tokens", 16), stream=stream)
    _check_fanout(len(prompts), options["n"], limits)
    options["logprobs"] = logprobs
    # NOTE: echo with logprobs shows the prompt's logprobs too (OpenAI's legacy shape)
    if echo and logprobs is not None:
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    options["prompt_logprobs"] = prompt_logprobs
    options["structured"] = read_constraint(fields)[0]
    request = CompletionRequest(
        model=fields.read_str("model", None),
        prompts=prompts,
        params=_sampling_params(options, {}),
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        logprobs=logprobs,
        user=fields.read_str("user", None),
        show_prompt_logprobs=fields.has("prompt_logprobs"),
    )
    fields.refuse_rest()
    return request


def parse_tokenize(data: Any) -> tuple[str | None, list[dict[str, Any]] | None, bool]:
    """``POST /tokenize``: ``(prompt, messages, add_special_tokens)``, exactly one of the two set."""
    fields = Fields(data)
    fields.read_str("model", None)
    prompt = fields.read_str("prompt", None)
    messages = read_messages(fields) if fields.has("messages") else None
    add_special = fields.read_bool("add_special_tokens", messages is None)
    fields.refuse_rest()
    if (prompt is None) == (messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    return prompt, messages, add_special


def parse_detokenize(data: Any) -> list[int]:
    """``POST /detokenize``: the token ids to turn back into text."""
    fields = Fields(data)
    fields.read_str("model", None)
    if not fields.has("tokens"):
        raise bad_request("tokens is required", "tokens", code="missing_required_parameter")
    tokens = fields.read_int_list("tokens")
    fields.refuse_rest()
    if any(t < 0 for t in tokens):
        raise bad_request("tokens must be non-negative token ids", "tokens")
    return tokens


def _read_sampling(fields: Fields, *, max_tokens: Any, stream: bool) -> dict[str, Any]:
    """The ``SamplingParams`` keyword arguments shared by chat and completions."""
    n = fields.read_int("n", 1)
    assert n is not None
    return {
        "n": n,
        "max_tokens": max_tokens,
        "min_tokens": fields.read_int("min_tokens", 0),
        "temperature": fields.read_float("temperature", UNSET),
        "top_p": fields.read_float("top_p", UNSET),
        "top_k": fields.read_int("top_k", UNSET),
        "min_p": fields.read_float("min_p", UNSET),
        "presence_penalty": fields.read_float("presence_penalty", 0.0),
        "frequency_penalty": fields.read_float("frequency_penalty", 0.0),
        "repetition_penalty": fields.read_float("repetition_penalty", UNSET),
        "seed": fields.read_int("seed", None),
        "stop": fields.read_stop("stop"),
        "stop_token_ids": fields.read_int_list("stop_token_ids"),
        "include_stop_str_in_output": fields.read_bool("include_stop_str_in_output", False),
        "ignore_eos": fields.read_bool("ignore_eos", False),
        "logit_bias": fields.read_logit_bias("logit_bias"),
        "skip_special_tokens": fields.read_bool("skip_special_tokens", True),
        # Streams want deltas; a whole response wants only the end (no merging on the way).
        "output_kind": OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
    }


def _sampling_params(options: dict[str, Any], names: Mapping[str, str]) -> SamplingParams:
    """Build the params; their range errors become 400s naming the field (``names``: the
    body's name for a param, where the two differ)."""
    try:
        return SamplingParams(**options)
    except RequestError as exc:
        param = names.get(exc.param, exc.param) if exc.param is not None else None
        raise bad_request(exc.message, param) from None


def _read_stream(fields: Fields) -> tuple[bool, bool]:
    """``(stream, include_usage)``; stream_options without stream is a 400, as at OpenAI."""
    stream = fields.read_bool("stream", False)
    options = fields.read_object("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.read_bool("include_usage", False)
    options.refuse_rest()
    return stream, include_usage


def _read_chat_max_tokens(fields: Fields) -> Any:
    """``max_completion_tokens`` wins over its deprecated alias ``max_tokens``; neither
    given: ``UNSET`` (the engine's ``default_max_tokens``)."""
    max_tokens = fields.read_int("max_tokens", None)
    max_completion = fields.read_int("max_completion_tokens", None)
    chosen, name = (
        (max_completion, "max_completion_tokens")
        if max_completion is not None
        else (max_tokens, "max_tokens")
    )
    if chosen is None:
        return UNSET
    if chosen < 1:
        raise bad_request(f"{name} must be a positive integer", name)
    return chosen


def _check_fanout(num_prompts: int, n: int, limits: Limits) -> None:
    """Refuse a request that would become more than ``max_fanout`` engine requests."""
    if num_prompts * n <= limits.max_fanout:
        return
    param = "prompt" if num_prompts > 1 else "n"
    raise bad_request(
        f"this request asks for {num_prompts} prompt(s) × n={n} = {num_prompts * n} "
        f"completions; this server allows at most {limits.max_fanout} per request",
        param,
    )


def _read_prompts(fields: Fields) -> list[Prompt]:
    """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
    value = fields.raw("prompt")
    if isinstance(value, str):
        return [check_text(value, "prompt")]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [check_text(p, "prompt") for p in value]
        if all(_is_token_id(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return [list(p) for p in value]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
        code="invalid_type",
    )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT_MAX
