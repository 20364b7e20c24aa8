"""Every model family on a CUDA device (skipped without one): the tiny model of each
(:mod:`tests.gpu.families`) through the engine in bfloat16, eagerly and through the CUDA
graphs, with FlashInfer where it is installed, against transformers' bfloat16 model on the
same device.

bfloat16 rounding decides near-ties of the top two logits, so a sequence may part from the
reference only where the reference's top-2 logprob gap is under :data:`TIE_MARGIN`, and
most tokens must be compared.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine, SamplingParams
from tests.gpu.families import FAMILY_CONFIGS, make_family_model
from tests.gpu.reference import PROMPTS

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16
TIE_MARGIN = 0.15
"""Top-2 logprob gap under which bfloat16 rounding may decide the greedy token."""
MIN_COMPARED = 0.6
MODES = {"eager": {"enforce_eager": True}, "graphs": {"enforce_eager": False}}


@pytest.fixture(scope="module")
def family_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            made[family] = make_family_model(folder, tokenizer_dir, family)
        return made[family]

    return get


def reference(folder: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' bfloat16 greedy ``generate`` on the GPU: tokens and top-2 gaps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            gaps = []
            for logits in out.logits:
                top = torch.log_softmax(logits[0].float(), -1).topk(2)
                gaps.append(float(top.values[0] - top.values[1]))
            results.append(([int(t) for t in out.sequences[0, len(prompt) :]], gaps))
    return results


CASES = [(family, "graphs") for family in FAMILY_CONFIGS] + [
    ("gemma2", "eager"),
    ("qwen3_moe", "eager"),
]
"""Every family through the graphs (eager prefill, graphed decode); the eager decode for
the two whose layers differ most (windows and soft caps; experts)."""


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_a_family_on_cuda_decodes_as_transformers(
    family: str, mode: str, family_dir: Callable[[str], Path], tokenizer: Any
) -> None:
    folder = family_dir(family)
    prompts = [list(tokenizer(p).input_ids) for p in PROMPTS]
    expected = reference(folder, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    options: dict[str, Any] = {"max_model_len": 128, "num_kv_blocks": 64, **MODES[mode]}
    eng = Engine(model=str(folder), device="cuda", dtype="bfloat16", **options)
    with closing(eng):
        outs = eng.generate(prompts, params, use_tqdm=False)
    compared = 0
    for i, (out, (ref, gaps)) in enumerate(zip(outs, expected, strict=True)):
        ids = list(out.outputs[0].token_ids)
        split = next((k for k, (a, b) in enumerate(zip(ids, ref, strict=True)) if a != b), None)
        if split is not None:
            assert gaps[split] < TIE_MARGIN, (family, mode, i, split, gaps[split])
        compared += NEW_TOKENS if split is None else split
    assert compared >= MIN_COMPARED * NEW_TOKENS * len(prompts), (family, mode, compared)
