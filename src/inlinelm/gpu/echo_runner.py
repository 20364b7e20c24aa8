"""A scripted runner with no weights: it echoes each prompt, then emits EOS.

The n-th generated token (n from 0) is ``prompt[n % (len(prompt) + 1)]``, where position
``len(prompt)`` stands for the EOS id (with no EOS id the cycle is just the prompt). It
drives the real scheduler and block pool, so the whole engine can be tested and
benchmarked on a CPU with hundreds of concurrent requests.
"""

from __future__ import annotations

import time

from inlinelm.config import EngineConfig
from inlinelm.sched.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from inlinelm.sched.request import Request


class EchoRunner:
    """Implements :class:`~inlinelm.sched.output.Runner` without a model.

    ``config.echo_step_s`` is slept once per step (releasing the GIL) to stand in for a
    device step. With ``check_kv`` it keeps a fake KV cache of token ids and checks, every
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
        self.eos_token_id = eos_token_id
        self.block_size = config.block_size
        self.step_s = config.echo_step_s
        self.num_steps = 0
        self._kv: list[list[int]] | None = None
        if check_kv:
            self._kv = [[-1] * config.block_size for _ in range(num_kv_blocks)]

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Echo one token for every request that reaches the end of its known tokens."""
        if self.step_s > 0:
            time.sleep(self.step_s)
        self.num_steps += 1
        out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        for item in batch.scheduled:
            self._write_kv(item)
            request = item.request
            # Same rule as the model runner: sample once the last known token is computed.
            if request.num_computed_tokens + item.num_tokens >= request.num_tokens:
                out.req_ids.append(request.request_id)
                out.sampled_token_ids.append(self.next_token(request))
        out.logprobs = self._logprobs(batch, out)
        return out

    def next_token(self, request: Request) -> int:
        """The token this runner emits after ``request``'s current output."""
        prompt = request.prompt_token_ids
        cycle = len(prompt) + (self.eos_token_id is not None)
        position = request.num_output_tokens % cycle
        if position == len(prompt):
            assert self.eos_token_id is not None
            return self.eos_token_id
        return prompt[position]

    def close(self) -> None:
        """Drop the fake KV cache."""
        self._kv = None

    def _write_kv(self, item: ScheduledRequest) -> None:
        if self._kv is None:
            return
        request, start = item.request, item.request.num_computed_tokens
        for position in range(start, start + item.num_tokens):
            block_id = request.block_ids[position // self.block_size]
            self._kv[block_id][position % self.block_size] = request.all_token_ids[position]
        self._check_kv(request, start + item.num_tokens)

    def _check_kv(self, request: Request, num_tokens: int) -> None:
        """Every token attention would read must be the request's own."""
        assert self._kv is not None
        for position in range(num_tokens):
            block_id = request.block_ids[position // self.block_size]
            stored = self._kv[block_id][position % self.block_size]
            assert stored == request.all_token_ids[position], (
                f"{request.request_id}: KV at {position} holds {stored}"
            )

    def _logprobs(
        self, batch: SchedulerOutput, out: ModelRunnerOutput
    ) -> list[TokenLogprobs | None] | None:
        """Scripted logprobs for requests that ask: the echoed token is certain (0.0)."""
        wanted = {i.request.request_id: i.request.params.logprobs for i in batch.scheduled}
        if all(wanted[req_id] is None for req_id in out.req_ids):
            return None
        return [
            _scripted_logprobs(token, wanted[req_id])
            for req_id, token in zip(out.req_ids, out.sampled_token_ids, strict=True)
        ]


def _scripted_logprobs(token_id: int, num_top: int | None) -> TokenLogprobs | None:
    if num_top is None:
        return None
    # Sampled token first, then the top-N: the echoed token, then its neighbours.
    top = [token_id + i for i in range(num_top)]
    return TokenLogprobs([token_id, *top], [0.0, *(-float(i) for i in range(num_top))], 1)
