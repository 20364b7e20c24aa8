"""What one applied step tells the frontend about a request: its sampled token (with its
logprobs, and the prompt's with the first), and how it finished (engine thread)."""

from __future__ import annotations

from inlinelm.sched.output import EngineCoreOutput, TokenLogprobs
from inlinelm.sched.request import FinishReason, Request
from inlinelm.sched.runner import ModelRunnerOutput


def token_output(request: Request, out: ModelRunnerOutput, index: int) -> EngineCoreOutput:
    """Append the token ``out`` sampled for ``request`` (row ``index``) and make its output;
    the prompt's logprobs, when asked for, go with the first token."""
    assert request.num_computed_tokens == len(request.all_token_ids), "sampled before the end"
    token_id = out.sampled_token_ids[index]
    request.append_output_token(token_id)
    output = EngineCoreOutput(
        request.request_id,
        [token_id],
        None,
        None,
        None if out.logprobs is None else _logprobs_at(out, index),
        request.num_cached_tokens,
    )
    if request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        request.prompt_logprobs_sent = True
        output.prompt_logprobs = request.prompt_logprobs
    return output


def pooled_output(request: Request, pooled: list[float]) -> EngineCoreOutput:
    """A pooling request's one output: its result, which finishes it."""
    return EngineCoreOutput(
        request.request_id,
        [],
        FinishReason.STOP,
        None,
        num_cached_tokens=request.num_cached_tokens,
        pooled=pooled,
    )


def finish_output(output: EngineCoreOutput, request: Request, reason: FinishReason) -> None:
    """Mark ``output`` as ``request``'s last: its finish and stop reasons, and why its
    grammar failed when that ended it."""
    if reason is FinishReason.ERROR and request.grammar is not None:
        output.error = (
            f"the output's grammar failed at output token {request.num_output_tokens}: "
            f"{request.grammar.error or 'it refused the token'}"
        )
    output.finish_reason = reason
    output.stop_reason = request.stop_reason


def keep_prompt_logprobs(request: Request, first: int, entries: list[TokenLogprobs]) -> None:
    """Record a step's prompt logprobs (entries from prompt index ``first``); a prompt
    computed again after preemption overwrites what it computed before."""
    kept = request.prompt_logprobs
    del kept[first:]
    kept.extend(entries)


def _logprobs_at(out: ModelRunnerOutput, index: int) -> list[TokenLogprobs] | None:
    entry = out.logprobs[index] if out.logprobs is not None else None
    return [entry] if entry is not None else None
