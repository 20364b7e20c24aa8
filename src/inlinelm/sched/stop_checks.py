"""When a request that just got a token ends: its grammar, EOS and stop tokens, its caps."""

from __future__ import annotations

from inlinelm.sched.request import FinishReason, Request


def check_stop(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Why ``request`` ends on ``token_id`` (just appended), or None: a grammar held back
    by a reasoning gate starts once the token completes the closing tag; the grammar (a refused
    token fails the request; EOS after a complete output stops it, whatever ``min_tokens``
    or ``ignore_eos`` say), EOS and stop tokens (not among the first ``min_tokens``; a stop
    token is recorded as the ``stop_reason``), then the length caps."""
    params = request.params
    grammar = request.grammar
    num_output = len(request.output_token_ids)  # NOTE: len(), not properties: hot path
    gate = request.grammar_gate
    if gate is not None and gate.opens_after(request.output_token_ids):
        # NOTE: the grammar starts after the closing tag, so it never sees the tag's tokens
        request.grammar, request.grammar_gate = gate.matcher, None
    elif grammar is not None:
        # NOTE: a complete output is not finished on its last token but on the EOS its
        # mask then forces, so the last token's text is shown and EOS is not.
        if not grammar.accept(token_id):
            return FinishReason.ERROR
        if token_id == request.eos_token_id and grammar.is_stopped:
            return FinishReason.STOP
    if num_output > params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return FinishReason.STOP
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return FinishReason.LENGTH
    if len(request.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None
