"""Scheduler driven by the EchoRunner: budgets, chunking, priority, preemption, finish checks."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import pytest

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.echo_runner import EchoRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.output import EngineCoreOutput, SchedulerOutput
from inlinelm.sched.request import FinishReason, Request, RequestStatus
from inlinelm.sched.runner import ModelRunnerOutput
from inlinelm.sched.scheduler import Scheduler

EOS = 2


class Harness:
    """Runs schedule → execute → update like the engine core, checking every batch.

    With ``pipelined``, like the engine core's pipelined loop: each :meth:`step` schedules
    and submits a batch, then collects and updates the batch submitted before it, so the
    scheduler always decides one step ahead of what it has applied.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        *,
        pipelined: bool = False,
        long_context_from: int | None = None,
    ):
        self.config = config
        self.pipelined = pipelined
        self.in_flight: list[SchedulerOutput] = []
        self.scheduler = Scheduler(config, num_blocks, EOS, long_context_from)
        self.runner = EchoRunner(config, num_blocks, EOS, check_kv=True)
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        self.first_scheduled: list[str] = []
        self.num_steps = 0

    def add(self, request_id: str, prompt: list[int], **params: Any) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(**params))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self, abort_mid_step: Iterable[str] = ()) -> SchedulerOutput:
        """Schedule and run one batch (returned); ``abort_mid_step`` is aborted between
        the collect and the update of the batch applied in this call."""
        batch = self.scheduler.schedule()
        self._check_batch(batch)
        if not self.pipelined:
            self._apply(batch, self.runner.execute(batch), abort_mid_step)
            return batch
        if batch.scheduled:
            self.runner.submit(batch)
            self.in_flight.append(batch)
        if len(self.in_flight) > 1 or (self.in_flight and not batch.scheduled):
            self._apply(self.in_flight.pop(0), self.runner.collect(), abort_mid_step)
        else:
            self.scheduler.abort_requests(abort_mid_step)
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and not self.in_flight:
                return
            self.step()
        pytest.fail("requests did not finish")

    def drain(self) -> None:
        """Collect and apply every batch still in flight (pipelined), scheduling nothing."""
        while self.in_flight:
            self._apply(self.in_flight.pop(0), self.runner.collect(), ())

    def _apply(
        self, batch: SchedulerOutput, out: ModelRunnerOutput, abort_mid_step: Iterable[str]
    ) -> None:
        self.scheduler.abort_requests(abort_mid_step)
        for output in self.scheduler.update_from_output(batch, out):
            self.outputs[output.request_id].append(output)
        self.num_steps += 1

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def finish(self, request_id: str) -> FinishReason | None:
        outputs = self.outputs[request_id]
        return outputs[-1].finish_reason if outputs else None

    def assert_all_blocks_free(self) -> None:
        pool = self.scheduler.kv_cache.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))

    def _check_batch(self, batch: SchedulerOutput) -> None:
        ids = [item.request.request_id for item in batch.scheduled]
        assert len(set(ids)) == len(ids)
        assert all(item.num_tokens >= 1 for item in batch.scheduled)
        assert batch.num_batched_tokens == sum(item.num_tokens for item in batch.scheduled)
        assert batch.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(batch.scheduled) <= self.config.max_num_seqs
        self.first_scheduled.extend(i for i in ids if i not in self.first_scheduled)


@pytest.fixture(params=[False, True], ids=["plain", "pipelined"])
def pipelined(request: pytest.FixtureRequest) -> bool:
    """Run the test with the plain step and with the pipelined one."""
    value: bool = request.param
    return value


def config(**options: Any) -> EngineConfig:
    defaults: dict[str, Any] = {"runner": "echo", "block_size": 4}
    return EngineConfig(**{**defaults, **options})


def test_every_request_gets_its_exact_echo(pipelined: bool) -> None:
    harness = Harness(config(), 64, pipelined=pipelined)
    prompts = {f"r{i}": list(range(10, 13 + i)) for i in range(8)}
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, max_tokens=50)
    harness.run()
    for request_id, prompt in prompts.items():
        assert harness.tokens(request_id) == EchoRunner.expected(prompt, 50, eos_token_id=EOS)
        assert harness.finish(request_id) is FinishReason.STOP
    harness.assert_all_blocks_free()


def test_budget_and_sequence_cap_hold_under_load(pipelined: bool) -> None:
    harness = Harness(config(max_num_batched_tokens=24, max_num_seqs=5), 200, pipelined=pipelined)
    for i in range(40):
        harness.add(f"r{i}", list(range(10, 10 + 3 + i % 30)), max_tokens=8)
    harness.run()  # every batch is checked against both limits
    assert all(harness.finish(f"r{i}") is not None for i in range(40))


def test_decodes_come_before_prefill_chunks(pipelined: bool) -> None:
    harness = Harness(config(max_num_batched_tokens=32), 64, pipelined=pipelined)
    harness.add("a", [10, 11, 12], max_tokens=20)
    harness.step()
    harness.add("b", list(range(10, 30)), max_tokens=20)
    batch = harness.step()
    assert [(i.request.request_id, i.num_tokens) for i in batch.scheduled] == [("a", 1), ("b", 20)]


def test_chunked_prefill_splits_a_long_prompt_within_the_budget(pipelined: bool) -> None:
    harness = Harness(
        config(max_num_batched_tokens=16, enable_prefix_caching=False), 64, pipelined=pipelined
    )
    prompt = list(range(10, 60))
    harness.add("long", prompt, max_tokens=3)
    chunks = [harness.step().scheduled[0].num_tokens for _ in range(4)]
    assert chunks == [16, 16, 16, 2]
    harness.drain()
    # Only the step that completed the prompt sampled a token.
    assert harness.tokens("long") == [10]
    harness.run()
    assert harness.tokens("long") == [10, 11, 12]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    cfg = config(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    harness = Harness(cfg, 64)
    harness.add("a", list(range(10, 20)), max_tokens=5)
    harness.add("b", list(range(30, 40)), max_tokens=5)
    # b (10 tokens) does not fit the 6 left by a, and is not split.
    batch = harness.step()
    assert [(i.request.request_id, i.num_tokens) for i in batch.scheduled] == [("a", 10)]
    batch = harness.step()
    assert [(i.request.request_id, i.num_tokens) for i in batch.scheduled] == [("a", 1), ("b", 10)]
    harness.run()
    assert harness.tokens("b") == EchoRunner.expected(list(range(30, 40)), 5, eos_token_id=EOS)


def test_without_chunked_prefill_max_model_len_must_fit_the_budget() -> None:
    cfg = config(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=32)
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be >= max_model_len"):
        Scheduler(cfg, 64, EOS)


def test_max_model_len_must_fit_the_kv_cache() -> None:
    with pytest.raises(ConfigError, match="needs more KV blocks") as raised:
        Scheduler(config(max_model_len=100), 10, EOS)
    assert raised.value.option == "max_model_len"


def test_priority_then_arrival_order_at_admission(pipelined: bool) -> None:
    harness = Harness(config(max_num_seqs=1), 64, pipelined=pipelined)
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]:
        harness.add(request_id, [10, 11], max_tokens=2, priority=priority)
    harness.run()
    assert harness.first_scheduled == ["b", "d", "c", "a", "e"]


def test_no_starvation_under_a_steady_stream_of_arrivals(pipelined: bool) -> None:
    harness = Harness(config(max_num_seqs=4, max_num_batched_tokens=32), 20, pipelined=pipelined)
    arrivals: list[str] = []
    for step in range(150):
        for k in range(2):
            request_id = f"r{step}-{k}"
            harness.add(request_id, list(range(10, 18 + k)), max_tokens=6)
            arrivals.append(request_id)
        harness.step()
    harness.run()
    # Admission follows arrival order exactly, and everyone finished with the right output.
    assert harness.first_scheduled == arrivals
    for request_id in arrivals:
        prompt = harness.requests[request_id].prompt_token_ids
        assert harness.tokens(request_id) == EchoRunner.expected(prompt, 6, eos_token_id=EOS)
    harness.assert_all_blocks_free()


def test_prefix_cache_hit_on_a_second_request_with_the_same_prefix() -> None:
    harness = Harness(config(), 64)
    prefix = list(range(100, 112))  # 3 full blocks
    harness.add("first", [*prefix, 20, 21], max_tokens=2)
    harness.run()
    harness.add("second", [*prefix, 30], max_tokens=20)
    batch = harness.step()
    assert batch.scheduled[0].num_tokens == 1  # 12 of 13 tokens came from the cache
    harness.run()
    assert harness.outputs["second"][0].num_cached_tokens == 12
    assert harness.outputs["first"][0].num_cached_tokens == 0
    assert harness.tokens("second") == EchoRunner.expected([*prefix, 30], 20, eos_token_id=EOS)
    stats = harness.scheduler.prefix_cache_stats
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (14 + 13, 12)


def test_prefix_caching_disabled_never_hits() -> None:
    harness = Harness(config(enable_prefix_caching=False), 64)
    prompt = list(range(100, 112))
    harness.add("first", prompt, max_tokens=2)
    harness.run()
    harness.add("second", list(prompt), max_tokens=2)
    harness.run()
    assert harness.outputs["second"][0].num_cached_tokens == 0
    assert harness.scheduler.prefix_cache_stats.num_hit_tokens == 0


def test_preemption_in_a_tiny_pool_still_gives_every_exact_output(pipelined: bool) -> None:
    # 12 blocks of 4 = 48 tokens for 12 requests that each grow to ~40 tokens.
    harness = Harness(config(max_num_batched_tokens=64, max_model_len=48), 12, pipelined=pipelined)
    prompts = {f"r{i}": [10 + i, *range(20, 36 + i)] for i in range(12)}
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, max_tokens=40)
    harness.run()
    assert harness.scheduler.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in harness.requests.values())
    for request_id, prompt in prompts.items():
        assert harness.tokens(request_id) == EchoRunner.expected(
            prompt, 40, eos_token_id=EOS, max_model_len=48
        )
    harness.assert_all_blocks_free()


def test_preempted_request_keeps_its_output_and_recomputes_it() -> None:
    harness = Harness(config(max_num_batched_tokens=64, max_model_len=24), 6)
    harness.add("old", list(range(10, 20)), max_tokens=12)
    harness.add("new", list(range(30, 40)), max_tokens=12)
    while harness.requests["new"].status is not RequestStatus.PREEMPTED:
        batch = harness.step()
    assert "new" in batch.removed_ids  # the runner is told to forget it
    assert harness.requests["new"].num_output_tokens > 0
    harness.run()
    assert harness.tokens("new") == EchoRunner.expected(list(range(30, 40)), 12, eos_token_id=EOS)


def test_a_request_growing_past_long_context_from_is_computed_again_once(
    pipelined: bool,
) -> None:
    # A longrope model rotates every position of a sequence past its original length with
    # the long factors: the step a request would pass 12 tokens, it is computed again from
    # its first token, and from then on decodes as usual.
    harness = Harness(config(), 64, pipelined=pipelined, long_context_from=12)
    prompt = list(range(10, 20))
    request = harness.add("r", prompt, max_tokens=8)
    computed: list[tuple[int, int]] = []
    while harness.scheduler.has_unfinished_requests() or harness.in_flight:
        batch = harness.step()
        computed += [(item.start, item.num_tokens) for item in batch.scheduled]
    assert computed == [(0, 10), (10, 1), (11, 1), (0, 13), (13, 1), (14, 1), (15, 1), (16, 1)]
    assert request.num_preemptions == 1 and request.long_context
    assert harness.tokens("r") == EchoRunner.expected(prompt, 8, eos_token_id=EOS)
    harness.assert_all_blocks_free()


def test_long_context_blocks_are_cached_apart_from_a_shorter_sequences() -> None:
    harness = Harness(config(), 64, long_context_from=12)
    prefix = list(range(100, 108))  # two full blocks
    longer = [*prefix, *range(50, 56)]  # 14 tokens: a long-context sequence from the start

    def first_chunk(request_id: str, prompt: list[int]) -> int:
        harness.add(request_id, prompt, max_tokens=1)
        batch = harness.step()
        harness.run()
        return batch.scheduled[0].num_tokens

    assert first_chunk("short", prefix) == 8
    assert first_chunk("long", longer) == 14  # the short sequence's blocks hold other KV
    assert first_chunk("long again", longer) == 2  # three long-context blocks hit
    assert first_chunk("short again", prefix) == 4  # a short one hits the short blocks


def test_eos_finishes_with_stop(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11, 12], max_tokens=10)
    harness.run()
    assert harness.tokens("a") == [10, 11, 12, EOS]
    last = harness.outputs["a"][-1]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, None)


def test_stop_token_id_finishes_with_its_id_as_stop_reason(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11, 12, 13], max_tokens=10, stop_token_ids=[12])
    harness.run()
    assert harness.tokens("a") == [10, 11, 12]
    last = harness.outputs["a"][-1]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, 12)


def test_max_tokens_finishes_with_length(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11, 12, 13], max_tokens=2)
    harness.run()
    assert harness.tokens("a") == [10, 11]
    assert harness.finish("a") is FinishReason.LENGTH


def test_max_model_len_finishes_with_length(pipelined: bool) -> None:
    harness = Harness(config(max_model_len=6), 16, pipelined=pipelined)
    harness.add("a", [10, 11, 12, 13], max_tokens=None)
    harness.run()
    assert harness.tokens("a") == [10, 11]
    assert harness.finish("a") is FinishReason.LENGTH


def test_without_max_model_len_configured_the_kv_cache_is_the_limit(pipelined: bool) -> None:
    harness = Harness(config(), 2, pipelined=pipelined)  # 2 blocks of 4 tokens
    assert harness.scheduler.max_model_len == 8
    harness.add("a", [10, 11, 12, 13], max_tokens=None, ignore_eos=True)
    harness.run()
    assert harness.tokens("a") == [10, 11, 12, 13]
    assert harness.finish("a") is FinishReason.LENGTH


def test_min_tokens_suppresses_eos_until_reached(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11], max_tokens=20, min_tokens=5)
    harness.run()
    assert harness.tokens("a") == [10, 11, EOS, 10, 11, EOS]
    assert harness.finish("a") is FinishReason.STOP


def test_min_tokens_suppresses_stop_tokens_until_reached(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11], max_tokens=20, min_tokens=2, stop_token_ids=[11], ignore_eos=True)
    harness.run()
    assert harness.tokens("a") == [10, 11, EOS, 10, 11]
    assert harness.outputs["a"][-1].stop_reason == 11


def test_ignore_eos_runs_to_max_tokens(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11], max_tokens=7, ignore_eos=True)
    harness.run()
    assert harness.tokens("a") == [10, 11, EOS, 10, 11, EOS, 10]
    assert harness.finish("a") is FinishReason.LENGTH


def test_eos_at_max_tokens_reports_stop(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11], max_tokens=3)
    harness.run()
    assert harness.tokens("a") == [10, 11, EOS]
    assert harness.finish("a") is FinishReason.STOP


def test_logprobs_pass_through_to_outputs(pipelined: bool) -> None:
    harness = Harness(config(), 16, pipelined=pipelined)
    harness.add("a", [10, 11], max_tokens=2, logprobs=2)
    harness.add("b", [10, 11], max_tokens=2)
    harness.run()
    first = harness.outputs["a"][0].new_logprobs
    assert first is not None and first[0].token_ids[0] == 10
    assert all(o.new_logprobs is None for o in harness.outputs["b"])


def test_abort_in_every_state_frees_blocks_and_is_idempotent() -> None:
    harness = Harness(config(max_num_batched_tokens=16, max_num_seqs=2), 64)
    harness.add("decoding", [10, 11], max_tokens=30, ignore_eos=True)
    harness.add("prefilling", list(range(10, 50)), max_tokens=30)
    harness.add("waiting", [10, 11], max_tokens=30)
    harness.step()
    harness.step()
    assert harness.requests["prefilling"].num_uncomputed_tokens > 1
    aborted = harness.scheduler.abort_requests(["decoding", "prefilling", "waiting", "nope"])
    assert aborted == ["decoding", "prefilling", "waiting"]
    assert harness.scheduler.abort_requests(["decoding"]) == []
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in harness.requests.values())
    assert not harness.scheduler.has_unfinished_requests()
    assert set(harness.scheduler.schedule().removed_ids) >= {"decoding", "prefilling"}
    harness.assert_all_blocks_free()


def test_abort_between_execute_and_update_drops_that_steps_token() -> None:
    harness = Harness(config(), 16)
    harness.add("a", [10, 11, 12], max_tokens=10)
    harness.add("b", [10, 11, 12], max_tokens=10)
    harness.step()
    harness.step(abort_mid_step=["a"])
    assert harness.tokens("a") == [10]
    assert harness.tokens("b") == [10, 11]
    harness.run()
    harness.assert_all_blocks_free()


def test_finished_request_output_and_removal() -> None:
    harness = Harness(config(), 16)
    harness.add("a", [10], max_tokens=1)
    harness.step()
    assert harness.finish("a") is FinishReason.LENGTH
    assert harness.scheduler.schedule().removed_ids == ["a"]


def _check_ref_counts(harness: Harness) -> None:
    """Every block's ref count equals the number of unfinished requests holding it."""
    holders: Counter[int] = Counter()
    for request in harness.requests.values():
        if not request.is_finished:
            holders.update(request.block_ids)
    pool = harness.scheduler.kv_cache.block_pool
    assert all(pool.ref_count(b) == holders[b] for b in range(pool.num_blocks))
    assert pool.num_used_blocks == len(holders)


def test_block_accounting_survives_a_random_mix_of_operations(pipelined: bool) -> None:
    rng = random.Random(20240521)
    cfg = config(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)
    harness = Harness(cfg, 24, pipelined=pipelined)
    prefixes = [[rng.randrange(10, 60) for _ in range(12)] for _ in range(4)]
    aborted_in: Counter[str] = Counter()
    live: list[str] = []
    for op in range(4000):
        action = rng.random()
        if action < 0.25:
            request_id = f"r{op}"
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)]
            prompt += [rng.randrange(10, 60) for _ in range(rng.randrange(0, 28))]
            harness.add(
                request_id, prompt, max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.3
            )
            live.append(request_id)
        elif action < 0.32 and live:
            victim = harness.requests[rng.choice(live)]
            aborted_in[_state_name(victim)] += 1
            harness.scheduler.abort_requests([victim.request_id])
        elif action < 0.36 and live:
            harness.step(abort_mid_step=[rng.choice(live)])
        else:
            harness.step()
        live = [i for i in live if not harness.requests[i].is_finished]
        _check_ref_counts(harness)
    harness.run()
    harness.assert_all_blocks_free()
    assert harness.scheduler.num_preemptions > 0
    assert {"waiting", "prefilling", "decoding", "preempted"} <= set(aborted_in)
    for request_id, request in harness.requests.items():
        params = request.params
        assert params.max_tokens is not None
        expected = EchoRunner.expected(
            request.prompt_token_ids,
            params.max_tokens,
            eos_token_id=EOS,
            ignore_eos=params.ignore_eos,
            max_model_len=64,
        )
        if request.status is RequestStatus.FINISHED_ABORTED:
            assert expected[: len(harness.tokens(request_id))] == harness.tokens(request_id)
        else:
            assert harness.tokens(request_id) == expected


def _state_name(request: Request) -> str:
    if request.status is RequestStatus.RUNNING:
        return "decoding" if request.num_uncomputed_tokens == 1 else "prefilling"
    return request.status.value


def test_pipelined_length_caps_waste_no_row_and_eos_wastes_one() -> None:
    harness = Harness(config(), 16, pipelined=True)
    harness.add("capped", [10, 11, 12], max_tokens=3)
    harness.add("eos", [20, 21], max_tokens=10)
    appearances: Counter[str] = Counter()
    while harness.scheduler.has_unfinished_requests() or harness.in_flight:
        appearances.update(item.request.request_id for item in harness.step().scheduled)
    assert harness.tokens("capped") == [10, 11, 12]
    assert harness.tokens("eos") == [20, 21, EOS]
    # capped: its prompt, then two decodes; the step after its third token is never taken.
    assert appearances["capped"] == 3
    # eos: its prompt, two decodes, and one row scheduled before EOS was seen (dropped).
    assert appearances["eos"] == 4
    assert harness.finish("eos") is FinishReason.STOP
    harness.assert_all_blocks_free()


def test_pipelined_preemption_takes_victims_whose_step_is_in_flight() -> None:
    harness = Harness(config(max_num_batched_tokens=64, max_model_len=48), 12, pipelined=True)
    in_flight_victims = []
    preempt = harness.scheduler._preempt

    def recording_preempt(request: Request) -> None:
        in_flight_victims.append(request.num_inflight_tokens > 0)
        preempt(request)

    harness.scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    prompts = {f"r{i}": [10 + i, *range(20, 36 + i)] for i in range(12)}
    for request_id, prompt in prompts.items():
        harness.add(request_id, prompt, max_tokens=40)
    harness.run()
    assert any(in_flight_victims)
    for request_id, prompt in prompts.items():
        assert harness.tokens(request_id) == EchoRunner.expected(
            prompt, 40, eos_token_id=EOS, max_model_len=48
        )
    harness.assert_all_blocks_free()
