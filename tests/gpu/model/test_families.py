"""Every model family against transformers on the CPU, in float32.

Each family's tiny model (:mod:`tests.gpu.families`: random weights built by transformers,
windows shorter than the prompts, four experts with top-2 routing) is run by our model
and by transformers' own eager one:

- the prefill logits agree within :func:`~tests.gpu.reference.logits_atol`;
- through :class:`~inlinelm.Engine`, with prefill chunked into pieces of a few tokens, 16
  greedy tokens of each prompt equal transformers' eager ``generate`` (with its KV cache)
  and each chosen token's logprob is
  within the same bound of transformers'; a divergence is allowed only from a position
  where the reference's top-2 logprob gap is under :data:`TIE_MARGIN`, and the test counts
  how often that happens (a family where most tokens go uncompared fails);
- a second pass over the same prompts hits the prefix cache, a KV cache too small for all
  of them preempts, and both still give the same tokens; seeded sampling with ``n=2`` gives
  the same choices however the requests are batched.

The features a family adds are checked to matter: without the window (or the soft cap)
the logits leave the bound, so the agreement above is not an accident of small weights.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine, SamplingParams
from tests.gpu.families import FAMILY_CONFIGS, make_family_model
from tests.gpu.reference import PROMPTS, load_ours, logits_atol, prefill_logits
from tests.helpers import core_of

FAMILIES = list(FAMILY_CONFIGS)
NEW_TOKENS = 16
TIE_MARGIN = 1e-3
"""Top-2 logprob gap under which float32 rounding may decide the greedy token."""
MIN_COMPARED = 0.75
"""The share of a family's greedy tokens that must be compared (not past a near-tie)."""

Greedy = list[tuple[list[int], list[float], list[float]]]
"""Per prompt: the greedy tokens, each one's logprob, and the top-2 logprob gap there."""


@pytest.fixture(scope="module")
def family_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[[str], Path]:
    """``family_dir(family)``: the family's tiny model folder, made once per module."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            made[family] = make_family_model(folder, tokenizer_dir, family)
        return made[family]

    return get


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer(p).input_ids) for p in PROMPTS]


def transformers_greedy(folder: Path, prompts: list[list[int]]) -> Greedy:
    """transformers' eager greedy ``generate`` (with its KV cache, as a decode runs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    results: Greedy = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logprobs, gaps = [], []
            for logits in out.logits:
                top = torch.log_softmax(logits[0].float(), -1).topk(2)
                logprobs.append(float(top.values[0]))
                gaps.append(float(top.values[0] - top.values[1]))
            results.append(([int(t) for t in out.sequences[0, len(prompt) :]], logprobs, gaps))
    return results


def engine(folder: Path, **options: Any) -> Engine:
    """A CPU engine on ``folder`` whose prefill runs in chunks of at most 8 tokens."""
    settings: dict[str, Any] = {
        "model": str(folder),
        "max_num_seqs": 8,
        "max_num_batched_tokens": 8,
        "max_model_len": 96,
        "num_threads": 1,
        **options,
    }
    return Engine(**settings)


def engine_greedy(eng: Engine, prompts: list[list[int]]) -> Greedy:
    """Greedy tokens (with their logprobs) of all ``prompts`` submitted at once."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = eng.generate(prompts, params, use_tqdm=False)
    results: Greedy = []
    for out in outs:
        choice = out.outputs[0]
        chosen = [lp.logprobs[0] for lp in choice.logprobs or []]
        results.append((list(choice.token_ids), chosen, []))
    return results


def assert_matches(got: Greedy, expected: Greedy, atol: float, what: str) -> int:
    """Equal tokens, and logprobs within ``atol``, up to a divergence where ``expected``
    saw a near-tie; returns how many tokens were compared."""
    compared = 0
    for i, ((ids, lps, _), (ref, ref_lps, gaps)) in enumerate(zip(got, expected, strict=True)):
        assert len(ids) == NEW_TOKENS, (what, i, len(ids))
        split = next((k for k, (a, b) in enumerate(zip(ids, ref, strict=True)) if a != b), None)
        end = NEW_TOKENS if split is None else split
        if split is not None:
            assert gaps[split] < TIE_MARGIN, (
                f"{what}: prompt {i} parts at token {split} where the top-2 gap is "
                f"{gaps[split]:.2e}: {ids[: split + 1]} vs {ref[: split + 1]}"
            )
        torch.testing.assert_close(
            torch.tensor(lps[:end]), torch.tensor(ref_lps[:end]), rtol=0.0, atol=atol
        )
        compared += end
    return compared


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(
    family: str, family_dir: Callable[[str], Path], prompt_ids: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    folder = family_dir(family)
    ours = load_ours(folder)
    ref = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for ids in prompt_ids:
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0]
        got = prefill_logits(ours, ids)
        torch.testing.assert_close(got, expected, rtol=0.0, atol=logits_atol(ours.config, expected))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_transformers_through_chunks_prefix_hits_and_preemption(
    family: str, family_dir: Callable[[str], Path], prompt_ids: list[list[int]]
) -> None:
    folder = family_dir(family)
    expected = transformers_greedy(folder, prompt_ids)
    # NOTE: the bound of the prefill logits test: a logprob is a logit minus a logsumexp
    # of logits, each within it (float32, the same layers).
    atol = 2 * max(
        logits_atol(load_ours(folder).config, torch.tensor([abs(lp) for lp in r[1]]))
        for r in expected
    )
    atol = max(atol, 1e-5)
    compared = 0
    with closing(engine(folder)) as eng:
        first = engine_greedy(eng, prompt_ids)
        compared += assert_matches(first, expected, atol, "first pass")
        again = engine_greedy(eng, prompt_ids)
        assert eng.stats()["prefix_cache_hit_tokens"] > 0
        compared += assert_matches(again, expected, atol, "prefix-cache hits")
    # NOTE: 6 blocks of 16 tokens hold two of the longest prompts with their answers.
    with closing(engine(folder, num_kv_blocks=6, enable_prefix_caching=False)) as eng:
        preempted = engine_greedy(eng, prompt_ids)
        assert core_of(eng).scheduler.num_preemptions > 0
        compared += assert_matches(preempted, expected, atol, "preempted")
    total = 3 * NEW_TOKENS * len(prompt_ids)
    assert compared >= MIN_COMPARED * total, f"{family}: only {compared}/{total} tokens compared"


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_n2_sampling_does_not_depend_on_the_batch(
    family: str, family_dir: Callable[[str], Path], prompt_ids: list[list[int]]
) -> None:
    folder = family_dir(family)
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)

    def sample(eng: Engine, prompts: list[list[int]]) -> list[list[list[int]]]:
        outs = eng.generate(prompts, params, use_tqdm=False)
        return [[list(c.token_ids) for c in out.outputs] for out in outs]

    with closing(engine(folder)) as eng:
        together = sample(eng, prompt_ids)
        alone = [sample(eng, [p])[0] for p in prompt_ids[:2]]
    assert together[:2] == alone
    assert all(len(choices) == 2 and all(len(c) == 8 for c in choices) for choices in together)
    assert any(a != b for a, b in together), "two choices of a prompt sample independently"


ABLATIONS: dict[str, Callable[[Any], Any]] = {
    "mistral": lambda spec: replace(spec, attention=replace(spec.attention, sliding_window=None)),
    "gemma2": lambda spec: replace(spec, attention=replace(spec.attention, softcap=None)),
    "gemma3_text": lambda spec: replace(
        spec, attention=replace(spec.attention, sliding_window=None)
    ),
    "smollm3": lambda spec: replace(spec, rope="global"),
}
"""Each family's feature turned off in every layer of our model."""


@pytest.mark.parametrize("family", list(ABLATIONS))
def test_without_its_feature_a_family_leaves_the_bound(
    family: str, family_dir: Callable[[str], Path], prompt_ids: list[list[int]]
) -> None:
    folder = family_dir(family)
    ours = load_ours(folder)
    ids = max(prompt_ids, key=len)
    expected = prefill_logits(ours, ids)
    for layer in ours.layers:
        attention = layer.self_attn
        spec = ABLATIONS[family](
            replace(ours.config.layers[0], attention=attention.layer, rope=attention.rope)
        )
        attention.layer, attention.rope = spec.attention, spec.rope
    changed = prefill_logits(ours, ids)
    assert (changed - expected).abs().max() > 10 * logits_atol(ours.config, expected)


def test_every_family_is_tested() -> None:
    from inlinelm.gpu.model.registry import FAMILIES as REGISTERED

    tested = {FAMILY_CONFIGS[f]["model_type"] for f in FAMILIES}
    assert tested == {t for family in REGISTERED for t in family.model_types}
