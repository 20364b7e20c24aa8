"""One log line per finished request: id, prompt/output tokens, TTFT, end-to-end time, finish reason.

Streamed requests report the TTFT seen on the wire (request reached the router → first
text written); whole responses report the engine's (arrival → first token).
"""

from __future__ import annotations

import logging
import time

from inlinelm.api.sse import StreamTally
from inlinelm.runtime.outputs import RequestOutput

logger = logging.getLogger("inlinelm.api")


def log_streamed(rid: str, tally: StreamTally) -> None:
    """Log a finished stream; one with no finish reason ended by an error or a disconnect."""
    reasons = [tally.finish_reasons[i] for i in sorted(tally.finish_reasons)]
    finish = ",".join(reasons) or tally.error or "disconnected"
    _log(rid, tally.prompt_tokens, tally.completion_tokens, tally.ttft, tally.arrival, finish)


def log_whole(rid: str, finals: list[RequestOutput], arrival: float) -> None:
    """Log a finished whole (non-streamed) response from its final outputs."""
    ttfts = [f.metrics.ttft for f in finals if f.metrics.ttft is not None]
    _log(
        rid,
        sum(len(f.prompt_token_ids) for f in finals),
        sum(len(c.token_ids) for f in finals for c in f.outputs),
        min(ttfts) if ttfts else None,
        arrival,
        ",".join(str(c.finish_reason) for f in finals for c in f.outputs),
    )


def _log(
    rid: str,
    prompt_tokens: int,
    output_tokens: int,
    ttft: float | None,
    arrival: float,
    finish: str,
) -> None:
    logger.info(
        "request %s: prompt_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs finish=%s",
        rid,
        prompt_tokens,
        output_tokens,
        "-" if ttft is None else f"{ttft:.3f}s",
        time.perf_counter() - arrival,
        finish,
    )
