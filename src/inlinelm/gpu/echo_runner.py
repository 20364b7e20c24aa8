"""A scripted runner with no weights: it echoes each prompt, then emits EOS.

The n-th generated token (n from 0) is ``prompt[n % (len(prompt) + 1)]``, where position
``len(prompt)`` stands for the EOS id (with no EOS id the cycle is just the prompt). It
drives the real scheduler and block pool, so the whole engine can be tested and
benchmarked on a CPU with hundreds of concurrent requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from inlinelm.config import EngineConfig
from inlinelm.sched.output import ScheduledRequest, SchedulerOutput, TokenLogprobs
from inlinelm.sched.request import Request
from inlinelm.sched.runner import ModelRunnerOutput
from inlinelm.structured.matcher import GrammarMatcher


class EchoRunner:
    """Implements :class:`~inlinelm.sched.output.PipelinedRunner` without a model.

    It stands in for a device with a ``config.echo_step_s`` step: :meth:`submit` does the
    host work (picking the tokens) and launches the step, which ends ``echo_step_s`` after
    both its launch and the end of the step before it (one stream); :meth:`collect`
    sleeps, releasing the GIL, until the oldest step has ended. :meth:`execute` is the two
    back to back. With ``check_kv`` it keeps a fake KV cache of token ids and checks, every
    step, that each scheduled request's blocks hold exactly its tokens: a prefix-cache or
    block-accounting bug then fails the step.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        eos_token_id: int | None = None,
        *,
        check_kv: bool = False,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.long_context_from: int | None = None
        self.eos_token_id = eos_token_id
        self.block_size = config.block_size
        self.step_s = config.echo_step_s
        self.num_steps = 0
        self._kv: list[list[int]] | None = None
        if check_kv:
            self._kv = [[-1] * config.block_size for _ in range(num_kv_blocks)]
        self._in_flight: deque[tuple[float, ModelRunnerOutput]] = deque()
        self._device_free_at = 0.0

    def start_on_thread(self) -> None:
        """Nothing belongs to the engine thread (see ``Runner.start_on_thread``)."""

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it."""
        self.submit(batch)
        return self.collect()

    def submit(self, batch: SchedulerOutput) -> None:
        """Echo one token for every scheduled request that samples, and launch the step."""
        out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        req_ids, sampled = out.req_ids, out.sampled_token_ids
        num_top: list[int | None] = []
        for item in batch.scheduled:
            if self._kv is not None:
                self._write_kv(item)
            if item.samples:
                request = item.request
                req_ids.append(request.request_id)
                end = item.start + item.num_tokens
                token = self.next_token(request, end - len(request.prompt_token_ids))
                if request.grammar is not None:
                    token = _follow_grammar(request.grammar, token)
                sampled.append(token)
                num_top.append(request.params.logprobs)
        if any(n is not None for n in num_top):
            out.logprobs = [_scripted_logprobs(t, n) for t, n in zip(sampled, num_top, strict=True)]
        ready_at = max(time.perf_counter(), self._device_free_at) + self.step_s
        self._device_free_at = ready_at
        self._in_flight.append((ready_at, out))

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest submitted step to end and return its tokens."""
        ready_at, out = self._in_flight.popleft()
        delay = ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self.num_steps += 1
        return out

    def next_token(self, request: Request, index: int) -> int:
        """The token this runner emits as ``request``'s output number ``index`` (from 0)."""
        return _echo_token(request.prompt_token_ids, index, self.eos_token_id)

    @staticmethod
    def expected(
        prompt: Sequence[int],
        max_tokens: int,
        *,
        eos_token_id: int | None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        max_model_len: int | None = None,
    ) -> list[int]:
        """The exact token ids an echo runner with ``eos_token_id`` emits for ``prompt``,
        as the scheduler's finish checks end it: at EOS once past ``min_tokens`` (unless
        ``ignore_eos``), at ``max_tokens``, or when prompt and output reach
        ``max_model_len``. A request with no grammar and no stop tokens."""
        limit = max_tokens
        if max_model_len is not None:
            limit = min(limit, max_model_len - len(prompt))
        out: list[int] = []
        while len(out) < limit:
            out.append(_echo_token(prompt, len(out), eos_token_id))
            if out[-1] == eos_token_id and not ignore_eos and len(out) > min_tokens:
                break
        return out

    def close(self) -> None:
        """Drop the fake KV cache."""
        self._kv = None
        self._in_flight.clear()

    def _token_at(self, request: Request, position: int) -> int:
        """The request's token at ``position``: known on the engine thread, or echoed by a
        step still in flight (what a device reads from its own sampled tokens)."""
        tokens = request.all_token_ids
        if position < len(tokens):
            return tokens[position]
        return self.next_token(request, position - len(request.prompt_token_ids))

    def _write_kv(self, item: ScheduledRequest) -> None:
        assert self._kv is not None
        request, start = item.request, item.start
        for position in range(start, start + item.num_tokens):
            block_id = request.block_ids[position // self.block_size]
            self._kv[block_id][position % self.block_size] = self._token_at(request, position)
        self._check_kv(request, start + item.num_tokens)

    def _check_kv(self, request: Request, num_tokens: int) -> None:
        """Every token attention would read must be the request's own."""
        assert self._kv is not None
        for position in range(num_tokens):
            block_id = request.block_ids[position // self.block_size]
            stored = self._kv[block_id][position % self.block_size]
            assert stored == self._token_at(request, position), (
                f"{request.request_id}: KV at {position} holds {stored}"
            )


def _echo_token(prompt: Sequence[int], index: int, eos_token_id: int | None) -> int:
    """The echo rule (see the module docstring): output number ``index`` of ``prompt``."""
    cycle = len(prompt) + (eos_token_id is not None)
    position = index % cycle
    if position == len(prompt):
        assert eos_token_id is not None
        return eos_token_id
    return prompt[position]


def _scripted_logprobs(token_id: int, num_top: int | None) -> TokenLogprobs | None:
    if num_top is None:
        return None
    # Sampled token first, then the top-N: the echoed token, then its neighbours.
    top = [token_id + i for i in range(num_top)]
    return TokenLogprobs([token_id, *top], [0.0, *(-float(i) for i in range(num_top))], 1)


def _follow_grammar(grammar: GrammarMatcher, token: int) -> int:
    """``token`` when the grammar allows it next, else the lowest id it allows."""
    mask: bytes = grammar.ll_matcher.compute_bitmask()  # little-endian int32 words
    if token // 8 < len(mask) and mask[token // 8] >> (token % 8) & 1:
        return token
    for i, byte in enumerate(mask):
        if byte:
            return i * 8 + (byte & -byte).bit_length() - 1
    return token  # nothing allowed: the scheduler's grammar check fails the request
