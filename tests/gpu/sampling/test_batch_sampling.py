"""The persistent sampling batch gives the metadata and samples of a fresh build: across
adds, removals (finish, preemption), appended tokens and rows reused with other settings."""

from __future__ import annotations

import random

import numpy as np
import torch

from inlinelm.gpu.input_batch import SamplingColumns
from inlinelm.gpu.sampling.batch_sampling import BatchSampling
from inlinelm.gpu.sampling.metadata import SamplingMetadata
from inlinelm.gpu.sampling.sampler import Sampler
from inlinelm.gpu.staging import HostStaging
from inlinelm.sampling_params import SamplingParams

VOCAB = 40
CPU = torch.device("cpu")

SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=5),
    SamplingParams(temperature=0.7, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=0.8, frequency_penalty=-0.3),
    SamplingParams(temperature=0.9, top_k=3, logprobs=2, logit_bias={3: 2.0, 7: -1.0}),
    SamplingParams(temperature=0.6, seed=11, presence_penalty=1.0),
]


class Model:
    """The persistent state as the runner keeps it, next to plain per-request lists."""

    def __init__(self, max_rows: int) -> None:
        self.columns = SamplingColumns(max_rows)
        self.sampling = BatchSampling(max_rows, VOCAB, CPU)
        self.free = list(range(max_rows))
        self.live: dict[str, tuple[int, SamplingParams, list[int], list[int]]] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self.order: list[str] = []

    def add(self, name: str, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        row = self.free.pop(0)
        self.columns.write(row, params)
        self.sampling.add_row(row, params, prompt, output)
        self.live[name] = (row, params, prompt, output)
        self.generators[row] = None if params.seed is None else torch.Generator().manual_seed(9)
        self.order.append(name)

    def remove(self, name: str) -> None:
        row = self.live.pop(name)[0]
        self.order.remove(name)
        self.free.append(row)

    def step(self, logits: torch.Tensor) -> tuple[SamplingMetadata, SamplingMetadata]:
        """This step's metadata both ways; records the persistent one's samples."""
        live = [self.live[n] for n in self.order]
        rows = np.array([r for r, *_ in live], dtype=np.int64)
        generators = [self.generators[int(r)] for r in rows]
        staging = HostStaging(CPU)
        finish = self.sampling.stage(self.order, rows, self.columns, generators, staging)
        staging.send()
        persistent = finish()
        fresh = SamplingMetadata.build(
            [p for _, p, _, _ in live],
            [prompt for _, _, prompt, _ in live],
            [out for *_, out in live],
            generators,
            VOCAB,
            CPU,
        )
        sampled = Sampler()(logits, persistent).sampled
        self.sampling.tables.record(torch.from_numpy(rows), sampled)
        for (_, _, _, out), token in zip(live, sampled.tolist(), strict=True):
            out.append(token)
        return persistent, fresh


def assert_same(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for name in a.__slots__:  # type: ignore[attr-defined]
        x, y = getattr(a, name), getattr(b, name)
        if name == "generators":
            assert x.keys() == y.keys()
        elif hasattr(x, "__slots__") and x is not None and y is not None:
            for field in x.__slots__:
                assert torch.equal(getattr(x, field), getattr(y, field)), (name, field)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and torch.equal(x, y), name
        else:
            assert x == y, name


def test_persistent_metadata_equals_a_fresh_build_across_adds_removals_and_appends() -> None:
    rng = random.Random(0)
    model = Model(max_rows=6)
    count = 0
    for step in range(60):
        # Finish, preempt (re-add the same request later with its tokens) or add.
        if model.order and rng.random() < 0.25:
            name = rng.choice(model.order)
            _, params, prompt, output = model.live[name]
            model.remove(name)
            if rng.random() < 0.5 and model.free:
                model.add(name, params, prompt, output)  # resumed after preemption
        while model.free and (not model.order or rng.random() < 0.3):
            count += 1
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            model.add(f"r{count}", rng.choice(SETTINGS), prompt, [])
        logits = torch.randn(len(model.order), VOCAB, generator=torch.Generator().manual_seed(step))
        persistent, fresh = model.step(logits.clone())
        assert_same(persistent, fresh)


def test_persistent_samples_equal_a_fresh_build() -> None:
    model = Model(max_rows=4)
    for i, params in enumerate(SETTINGS[2:6]):
        model.add(f"a{i}", params, [1, 2, 3 + i], [])
    for step in range(12):
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(step))
        persistent, fresh = model.step(logits.clone())
        torch.manual_seed(step)
        got = Sampler()(logits.clone(), persistent).sampled
        torch.manual_seed(step)
        want = Sampler()(logits.clone(), fresh).sampled
        assert torch.equal(got, want)


def test_a_reused_row_takes_the_new_requests_penalties_and_tokens() -> None:
    model = Model(max_rows=1)
    model.add("a", SETTINGS[4], [5, 6], [7])
    model.step(torch.zeros(1, VOCAB))
    model.remove("a")
    model.add("b", SETTINGS[2], [9], [])  # other penalties, other tokens, same row
    persistent, fresh = model.step(torch.zeros(1, VOCAB))
    assert_same(persistent, fresh)
    model.remove("b")
    model.add("c", SETTINGS[0], [1], [])  # no penalty at all
    persistent, fresh = model.step(torch.zeros(1, VOCAB))
    assert persistent.no_penalties
    assert_same(persistent, fresh)


def test_the_metadata_is_reused_while_the_rows_stay_the_same() -> None:
    model = Model(max_rows=3)
    model.add("a", SETTINGS[1], [1], [])
    model.add("b", SETTINGS[2], [2], [])
    first, _ = model.step(torch.zeros(2, VOCAB))
    second, fresh = model.step(torch.zeros(2, VOCAB))
    assert second.temperature is first.temperature
    assert second.repetition is not first.repetition
    assert_same(second, fresh)
    model.add("c", SETTINGS[3], [3], [])
    third, _ = model.step(torch.zeros(3, VOCAB))
    assert third.temperature is not first.temperature
