"""Grammar masks in the model runner and the scheduler (CPU, tiny model): constrained rows
follow their grammar through preemption and the pipelined loop, with the same tokens as the
plain loop; a token the grammar refuses fails only its request."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inlinelm.config import EngineConfig
from inlinelm.gpu.model_runner import ModelRunner
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import FinishReason, Request
from inlinelm.sched.runner import ModelRunnerOutput
from inlinelm.sched.scheduler import Scheduler
from inlinelm.structured import StructuredOutput
from inlinelm.structured.compiler import GrammarCompiler
from tests.gpu.reference import PROMPTS
from tests.gpu.test_model_runner import run_to_completion
from tests.gpu.test_pipelined_runner import _both

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutput.json_schema(SCHEMA),
    StructuredOutput.regex(r"[a-d]{2,4}-[0-9]{1,3}"),
    StructuredOutput.choice(["red", "green", "blue"]),
]
PLAIN = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _mixed(tokenizer: Any, compiler: GrammarCompiler, priority: int = 0) -> list[Request]:
    """Every prompt twice: once unconstrained, once with one of ``SPECS`` (and ``priority``:
    1 makes them the first victims of preemption)."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt).input_ids
        spec = SPECS[i % len(SPECS)]
        params = SamplingParams(temperature=0.0, max_tokens=40, structured=spec, priority=priority)
        constrained = Request(f"g{i}", ids, params, EOS)
        constrained.grammar = compiler.compile(spec).new_matcher()
        requests += [Request(f"u{i}", ids, PLAIN, EOS), constrained]
    return requests


def _check_constrained(
    tokenizer: Any, requests: list[Request], outputs: dict[str, list[int]]
) -> None:
    for request in requests:
        spec = request.params.structured
        if spec is None:
            continue
        tokens = outputs[request.request_id]
        assert tokens[-1] == EOS and request.finish_reason is FinishReason.STOP, tokens
        text = tokenizer.decode(tokens[:-1])
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.text, text), text
        else:
            assert text in spec.choices


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 48, "max_num_batched_tokens": 32},
    ],
    ids=["one-shot", "chunks-of-7", "preemption"],
)
def test_pipelined_equals_plain_with_grammars(
    options: dict[str, Any], tiny_model_dir: Path, tokenizer: Any, compiler: GrammarCompiler
) -> None:
    plain, piped, requests = _both(
        tiny_model_dir, lambda: _mixed(tokenizer, compiler), **{"max_model_len": 256, **options}
    )
    assert piped == plain
    _check_constrained(tokenizer, requests, piped)


def test_preempted_request_keeps_its_grammar_state(
    tiny_model_dir: Path, tokenizer: Any, compiler: GrammarCompiler
) -> None:
    def outputs(num_kv_blocks: int) -> tuple[dict[str, list[int]], list[Request]]:
        config = EngineConfig(
            model=str(tiny_model_dir), num_kv_blocks=num_kv_blocks, block_size=4, max_model_len=48
        )
        requests = _mixed(tokenizer, compiler, priority=1)
        runner = ModelRunner(config, tiny_model_dir)
        return run_to_completion(runner, Scheduler(config, num_kv_blocks, EOS), requests), requests

    roomy, _ = outputs(256)
    tight, requests = outputs(12)
    assert any(r.num_preemptions for r in requests if r.grammar is not None)
    assert tight == roomy
    _check_constrained(tokenizer, requests, tight)


def test_constrained_request_waits_for_its_token_in_flight(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    scheduler = Scheduler(EngineConfig(num_kv_blocks=64), 64, EOS)
    for request in _mixed(tokenizer, compiler)[:2]:
        scheduler.add_request(request)
    first = scheduler.schedule()  # both prefill and sample
    assert {i.request.request_id for i in first.scheduled} == {"u0", "g0"}
    second = scheduler.schedule()  # pipelined: step one is still in flight
    assert [i.request.request_id for i in second.scheduled] == ["u0"]


def test_refused_token_fails_only_its_request(tokenizer: Any, compiler: GrammarCompiler) -> None:
    scheduler = Scheduler(EngineConfig(num_kv_blocks=64), 64, EOS)
    requests = _mixed(tokenizer, compiler)[:2]
    for request in requests:
        scheduler.add_request(request)
    batch = scheduler.schedule()
    bad = tokenizer.encode("zzz")[0]  # not the start of a JSON object
    outputs = scheduler.update_from_output(batch, ModelRunnerOutput(["u0", "g0"], [bad, bad]))
    reasons = {o.request_id: o.finish_reason for o in outputs}
    assert reasons == {"u0": None, "g0": FinishReason.ERROR}
    assert scheduler.get_request("u0") is not None and scheduler.get_request("g0") is None


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["eager", "graphs"])
def test_pipelined_equals_plain_with_grammars_on_cuda(
    static: bool, tiny_model_dir: Path, tokenizer: Any, compiler: GrammarCompiler
) -> None:
    plain, piped, requests = _both(
        tiny_model_dir,
        lambda: _mixed(tokenizer, compiler),
        static=static,
        device="cuda",
        max_model_len=256,
    )
    assert piped == plain
    _check_constrained(tokenizer, requests, piped)
