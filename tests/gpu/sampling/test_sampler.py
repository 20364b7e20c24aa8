"""The batched sampler and its metadata, on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from inlinelm.gpu.sampling.metadata import SamplingMetadata
from inlinelm.gpu.sampling.sampler import (
    Sampler,
    SamplerOutput,
    apply_occurrence_penalty,
    apply_repetition_penalty,
    to_token_logprobs,
)
from inlinelm.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 64


def build(
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    vocab_size: int = V,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        vocab_size,
        CPU,
    )


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    return Sampler()(logits.clone(), meta)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen(seed)) * scale


def repeated(probs: Sequence[float], rows: int, vocab: int = V) -> torch.Tensor:
    """``rows`` copies of logits whose softmax is ``probs`` (other tokens get ~0)."""
    logits = torch.full((vocab,), -1e4)
    logits[: len(probs)] = torch.tensor(probs).log()
    return logits.expand(rows, vocab).clone()


# -- greedy ---------------------------------------------------------------------------------


def test_all_greedy_is_argmax_on_the_fast_path_without_touching_logits() -> None:
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 4
    meta = build(params)
    assert meta.all_greedy and meta.plain_greedy and meta.temperature is None
    before = logits.clone()
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled, before.argmax(dim=-1))
    assert out.sampled.dtype == torch.int64 and out.logprobs is None
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    out = sample(torch.empty(0, V), build([]))
    assert out.sampled.shape == (0,)


# -- seeds ----------------------------------------------------------------------------------


def run_steps(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None],
    steps: int = 6,
) -> list[list[int]]:
    """Sample ``steps`` times with persistent per-row generators; tokens per row."""
    generators = [None if s is None else gen(s) for s in seeds]
    meta = build(params, generators=generators)
    tokens = [sample(logits, meta).sampled.tolist() for _ in range(steps)]
    return [list(column) for column in zip(*tokens, strict=True)]


def test_seed_gives_the_same_tokens_whatever_the_batch_and_row() -> None:
    torch.manual_seed(0)
    mine = SamplingParams(temperature=0.8, top_k=20, seed=7)
    row = random_logits(1, seed=1)
    alone = run_steps(row, [mine], [7])[0]
    others = random_logits(5, seed=2)
    batch = torch.cat([others[:3], row, others[3:]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=3),
        SamplingParams(top_p=0.5),
        mine,
        SamplingParams(min_p=0.1, repetition_penalty=1.3),
        SamplingParams(top_k=5),
    ]
    mixed = run_steps(batch, params, [None, 3, None, 7, None, None])
    assert mixed[3] == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, V)
    params = [SamplingParams(seed=1)]
    first = run_steps(logits, params, [1], steps=20)[0]
    again = run_steps(logits, params, [1], steps=20)[0]
    other = run_steps(logits, params, [2], steps=20)[0]
    assert first == again
    assert first != other


def test_greedy_rows_do_not_draw_from_their_generator() -> None:
    g = gen(5)
    state = g.get_state()
    meta = build([SamplingParams(temperature=0.0, seed=5), SamplingParams()], generators=[g, None])
    assert meta.generators == {}
    sample(random_logits(2), meta)
    assert torch.equal(g.get_state(), state)


# -- truncation -----------------------------------------------------------------------------

PROBS = [0.4, 0.3, 0.2, 0.1]


def draw(params: SamplingParams, rows: int = 4000, probs: Sequence[float] = PROBS) -> torch.Tensor:
    torch.manual_seed(1234)
    return sample(repeated(probs, rows), build([params] * rows)).sampled


def assert_distribution(tokens: torch.Tensor, expected: dict[int, float]) -> None:
    """Every token in ``expected``'s support, each frequency within 0.03 of its probability."""
    assert set(tokens.tolist()) == set(expected)
    freq = torch.bincount(tokens, minlength=V).float() / tokens.numel()
    for token, p in expected.items():
        assert abs(freq[token].item() - p) < 0.03, (token, freq[token].item(), p)


def renormalised(keep: Sequence[int]) -> dict[int, float]:
    total = sum(PROBS[t] for t in keep)
    return {t: PROBS[t] / total for t in keep}


def test_untruncated_sampling_follows_softmax() -> None:
    assert_distribution(draw(SamplingParams()), renormalised([0, 1, 2, 3]))


@pytest.mark.parametrize(("k", "keep"), [(2, [0, 1]), (3, [0, 1, 2]), (-1, [0, 1, 2, 3])])
def test_top_k_keeps_the_k_most_likely(k: int, keep: list[int]) -> None:
    assert_distribution(draw(SamplingParams(top_k=k)), renormalised(keep))


@pytest.mark.parametrize(("p", "keep"), [(0.35, [0]), (0.6, [0, 1]), (0.85, [0, 1, 2])])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(p: float, keep: list[int]) -> None:
    assert_distribution(draw(SamplingParams(top_p=p)), renormalised(keep))


@pytest.mark.parametrize(("min_p", "keep"), [(0.6, [0, 1]), (0.4, [0, 1, 2]), (0.9, [0])])
def test_min_p_drops_tokens_below_min_p_times_the_best(min_p: float, keep: list[int]) -> None:
    assert_distribution(draw(SamplingParams(min_p=min_p)), renormalised(keep))


def test_top_k_then_top_p_in_one_row() -> None:
    # top-k 3 renormalises to [4/9, 3/9, 2/9]; top-p 0.7 then keeps the first two.
    assert_distribution(draw(SamplingParams(top_k=3, top_p=0.7)), renormalised([0, 1]))


@pytest.mark.parametrize("with_top_p", [False, True])
def test_per_row_truncation_in_one_batch(with_top_p: bool) -> None:
    # Random logits, many draws: every sampled token lies in its row's allowed set.
    rows = [
        SamplingParams(top_k=3),
        SamplingParams(top_k=10, temperature=1.5),
        SamplingParams(),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=7, min_p=0.05),
        SamplingParams(top_p=0.5 if with_top_p else 1.0, temperature=0.5),
    ]
    logits = random_logits(len(rows), seed=3)
    meta = build(rows * 500)
    assert (meta.top_p is not None) == with_top_p
    torch.manual_seed(0)
    tokens = sample(logits.repeat(500, 1), meta).sampled.view(500, len(rows))
    for i, p in enumerate(rows):
        allowed = allowed_tokens(logits[i] / p.temperature, p)
        assert set(tokens[:, i].tolist()) <= allowed
        if len(allowed) > 1:
            assert len(set(tokens[:, i].tolist())) > 1


def allowed_tokens(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The reference truncation, one row at a time in probability space."""
    order = logits.argsort(descending=True).tolist()
    if p.top_k > 0:
        order = order[: p.top_k]
    probs = logits[order].softmax(dim=0)
    cumulative = probs.cumsum(dim=0)
    keep = int((cumulative < p.top_p).sum().item()) + 1
    order, probs = order[:keep], probs[:keep]
    return {t for t, q in zip(order, probs.tolist(), strict=True) if q >= p.min_p * probs[0]}


# -- penalties and bias ---------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    meta = build(
        [SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1]], vocab_size=4
    )
    assert meta.repetition is not None
    apply_repetition_penalty(logits, meta.repetition)
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 8)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    meta = build([params], prompts=[[1, 1, 2]], outputs=[[3, 3, 5]], vocab_size=8)
    assert meta.occurrence is not None and meta.repetition is None
    apply_occurrence_penalty(logits, meta.occurrence)
    assert logits.tolist() == [[0.0, 0.0, 0.0, -1.0, 0.0, -0.75, 0.0, 0.0]]


def reference_processed(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Bias, then repetition, then presence/frequency, then temperature, token by token."""
    out = [x + p.logit_bias.get(t, 0.0) for t, x in enumerate(logits)]
    seen = set(prompt) | set(output)
    r = p.repetition_penalty
    out = [(x / r if x > 0 else x * r) if t in seen else x for t, x in enumerate(out)]
    out = [
        x - p.frequency_penalty * output.count(t) - p.presence_penalty * (t in output)
        for t, x in enumerate(out)
    ]
    temperature = 1.0 if p.greedy else p.temperature
    return torch.tensor(out) / temperature


def full_logprobs(info: list[int], values: list[float], vocab: int) -> torch.Tensor:
    dense = torch.full((vocab,), float("nan"))
    dense[info] = torch.tensor(values)
    return dense


def test_logprobs_are_log_softmax_of_the_processed_logits() -> None:
    vocab = 16
    params = [
        SamplingParams(temperature=0.0, logprobs=16, repetition_penalty=1.5, logit_bias={4: 2.0}),
        SamplingParams(temperature=0.7, logprobs=16, presence_penalty=0.3, frequency_penalty=-0.4),
        SamplingParams(temperature=1.3, logprobs=16, repetition_penalty=0.8, logit_bias={0: -1}),
    ]
    prompts, outputs = [[1, 2, 4], [3], [5, 6]], [[2, 2, 7], [3, 8, 8, 9], [6, 0]]
    logits = random_logits(3, vocab, seed=4)
    meta = build(params, prompts=prompts, outputs=outputs, vocab_size=vocab)
    out = sample(logits, meta)
    rows = to_token_logprobs(out, meta.num_logprobs)
    for i, p in enumerate(params):
        info = rows[i]
        assert info is not None
        expected = reference_processed(logits[i].tolist(), p, prompts[i], outputs[i])
        got = full_logprobs(info.token_ids[1:], info.logprobs[1:], vocab)
        torch.testing.assert_close(got, expected.log_softmax(dim=0))
    assert (
        out.sampled[0].item()
        == reference_processed(logits[0].tolist(), params[0], prompts[0], outputs[0])
        .argmax()
        .item()
    )


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = random_logits(200, seed=5, scale=1.0)
    best = logits.argmax(dim=-1)
    torch.manual_seed(0)
    forced = sample(logits, build([SamplingParams(logit_bias={9: 100})] * 200)).sampled
    assert forced.eq(9).all()
    banned = [SamplingParams(temperature=0.0, logit_bias={int(t): -100}) for t in best]
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert torch.equal(sample(logits, build(banned)).sampled, second)
    never = sample(logits, build([SamplingParams(top_k=5, logit_bias={3: -100})] * 200))
    assert not never.sampled.eq(3).any()


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_ranks_top_n_and_per_row_truncation() -> None:
    params = [
        SamplingParams(temperature=0.7, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=1.0, logprobs=3, top_k=4, seed=1),
    ]
    logits = random_logits(4, seed=6)
    meta = build(params, generators=[None, None, None, gen(1)])
    assert meta.max_num_logprobs == 5
    torch.manual_seed(0)
    out = sample(logits, meta)
    rows = to_token_logprobs(out, meta.num_logprobs)
    assert rows[2] is None
    for i, p in enumerate(params):
        info = rows[i]
        if info is None:
            continue
        assert p.logprobs is not None
        reference = (logits[i] / (1.0 if p.greedy else p.temperature)).log_softmax(dim=0)
        token = int(out.sampled[i])
        assert info.token_ids[0] == token
        assert info.logprobs[0] == pytest.approx(reference[token].item(), abs=1e-5)
        assert info.sampled_rank == 1 + int((reference > reference[token]).sum())
        top = reference.sort(descending=True)
        assert info.token_ids[1:] == top.indices[: p.logprobs].tolist()
        assert info.logprobs[1:] == pytest.approx(top.values[: p.logprobs].tolist(), abs=1e-5)
        assert info.logprobs[1:] == sorted(info.logprobs[1:], reverse=True)
    assert rows[1] is not None and rows[1].sampled_rank == 1 and len(rows[1].token_ids) == 1


def test_no_logprobs_requested_gives_none_rows() -> None:
    meta = build([SamplingParams(), SamplingParams(temperature=0.0)])
    out = sample(random_logits(2), meta)
    assert out.logprobs is None
    assert to_token_logprobs(out, meta.num_logprobs) == [None, None]


# -- metadata and mixed batches ---------------------------------------------------------------


def test_metadata_leaves_out_unused_tensors() -> None:
    meta = build(
        [SamplingParams(), SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.0)]
    )
    assert meta.no_penalties and meta.no_logit_bias
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.max_num_logprobs is None and not meta.all_greedy and not meta.all_random
    assert meta.greedy_mask is not None and meta.greedy_mask.tolist() == [False, True]


def test_metadata_gives_greedy_rows_neutral_values() -> None:
    params = [
        SamplingParams(temperature=0.0, top_p=0.3),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9),
    ]
    meta = build(params)
    assert meta.temperature is not None and meta.temperature.tolist() == [1.0, 0.5]
    assert meta.top_k is not None and meta.top_k.tolist() == [V, 3] and meta.max_top_k == 3
    assert meta.top_p is not None and meta.top_p.tolist() == pytest.approx([1.0, 0.9])


def test_mixed_batch() -> None:
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=2),
        SamplingParams(temperature=0.9, seed=11, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=6, presence_penalty=0.5),
        SamplingParams(top_k=1, repetition_penalty=1.2, logit_bias={0: 5.0}),
        SamplingParams(temperature=0.5, min_p=0.1, seed=12, logprobs=1),
    ]
    prompts = [[1, 2], [3], [4, 5, 6], [0, 7], [8]]
    outputs = [[9, 9], [10], [11, 12], [13], []]
    logits = random_logits(len(params), seed=7)
    meta = build(
        params,
        prompts=prompts,
        outputs=outputs,
        generators=[None, gen(11), None, None, gen(12)],
    )
    out = sample(logits, meta)
    for i in (0, 3):
        expected = reference_processed(logits[i].tolist(), params[i], prompts[i], outputs[i])
        assert out.sampled[i].item() == expected.argmax().item()
    for i, seed in ((1, 11), (4, 12)):
        single = build(
            [params[i]], prompts=[prompts[i]], outputs=[outputs[i]], generators=[gen(seed)]
        )
        assert out.sampled[i].item() == sample(logits[i : i + 1], single).sampled.item()
    top6 = set(
        reference_processed(logits[2].tolist(), params[2], [], outputs[2]).topk(6).indices.tolist()
    )
    assert out.sampled[2].item() in top6
    rows = to_token_logprobs(out, meta.num_logprobs)
    assert [None if r is None else len(r.token_ids) for r in rows] == [3, None, None, None, 2]


# -- on the device --------------------------------------------------------------------------


@pytest.mark.gpu
def test_seed_is_batch_invariant_on_cuda_at_full_size() -> None:
    device, vocab, rows = torch.device("cuda"), 49152, 256
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.1)
    logits = (torch.randn(rows, vocab, generator=gen(0)) * 3).to(device)

    def tokens(batch: torch.Tensor, params: list[SamplingParams], row: int) -> list[int]:
        generators: list[torch.Generator | None] = [None] * len(params)
        generators[row] = torch.Generator(device).manual_seed(7)
        n = len(params)
        meta = SamplingMetadata.build(params, [[1, 2]] * n, [[3]] * n, generators, vocab, device)
        return [int(Sampler()(batch.clone(), meta).sampled[row]) for _ in range(5)]

    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=50), SamplingParams()]
    batch_params = [others[i % 3] for i in range(rows)]
    batch_params[100] = mine
    alone = tokens(logits[100:101], [mine], 0)
    assert tokens(logits, batch_params, 100) == alone


class FakeKernel:
    """A :class:`~inlinelm.gpu.sampling.sampler.RandomKernel` that records its calls and picks argmax."""

    def __init__(self) -> None:
        self.num_rows: list[int] = []

    def __call__(
        self, probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        self.num_rows.append(probs.shape[0])
        return probs.argmax(dim=-1).int()


def _seeded(seed: int) -> torch.Generator:
    generator = torch.Generator(CPU)
    generator.manual_seed(seed)
    return generator


def test_kernel_samples_unseeded_rows_and_seeded_rows_keep_their_stream() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_k=5, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.8, seed=4),
    ]
    generators = [None, _seeded(3), None, _seeded(4)]
    kernel = FakeKernel()
    out = Sampler(kernel)(logits.clone(), build(params, generators=generators))
    assert kernel.num_rows == [4]
    assert out.sampled[0] == logits[0].argmax()  # the kernel's pick
    assert out.sampled[2] == logits[2].argmax()  # greedy
    # Seeded rows: the same tokens as the torch path alone, whatever their batch.
    alone = [
        Sampler()(logits[i : i + 1].clone(), build([params[i]], generators=[_seeded(s)])).sampled
        for i, s in ((1, 3), (3, 4))
    ]
    assert out.sampled[1] == alone[0][0] and out.sampled[3] == alone[1][0]


def test_kernel_is_skipped_with_min_p_or_only_seeded_rows() -> None:
    logits = torch.randn(2, V)
    kernel = FakeKernel()
    Sampler(kernel)(logits.clone(), build([SamplingParams(temperature=1.0, min_p=0.1)] * 2))
    seeded = [SamplingParams(temperature=1.0, seed=1)] * 2
    Sampler(kernel)(logits.clone(), build(seeded, generators=[_seeded(1), _seeded(2)]))
    assert kernel.num_rows == []
