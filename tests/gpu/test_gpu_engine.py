"""The whole engine on a CUDA device (skipped without one): greedy tokens in every engine
mode against each other and against transformers on the same GPU, 256 streams through the
runtime and the router, and the device memory returned on close.

The model is SmolLM2-135M-shaped (the default model's config and tokenizer, shipped in
``benchmarks/gpu_assets`` because the default model's GGUF cannot travel to the device)
with random weights. Greedy tokens from two implementations can part at a near-tie of the
top two logits, where rounding decides; a sequence may therefore differ only from a
position whose top-2 logprob gap is below the dtype's tie margin, and most positions must
be compared.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine, SamplingParams
from tests.gpu.reference import PROMPTS
from tests.runtime.helpers import assert_drained, run

pytestmark = pytest.mark.gpu

ASSETS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
NEW_TOKENS = 32
TIE_MARGIN = {"float32": 1e-3, "bfloat16": 0.15}
"""Top-2 logprob gap under which two implementations may pick different greedy tokens."""
MODES = {
    "eager": {"enforce_eager": True, "async_scheduling": False},
    "eager-pipelined": {"enforce_eager": True, "async_scheduling": True},
    "graphs": {"enforce_eager": False, "async_scheduling": False},
    "graphs-pipelined": {"enforce_eager": False, "async_scheduling": True},
}

Greedy = list[tuple[list[int], list[float]]]
"""Per prompt: the greedy tokens and the top-2 logprob gap at each position."""


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-depth SmolLM2-135M-shaped model with random float32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("smollm2-random")
    options = json.loads((ASSETS / "config.json").read_text())
    options.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(options.pop("model_type"), **options)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return [list(tokenizer(p).input_ids) for p in PROMPTS]


def engine(folder: Path, dtype: str, **options: Any) -> Engine:
    return Engine(
        model=str(folder),
        device="cuda",
        dtype=dtype,
        attention_backend="auto",
        max_num_seqs=16,
        max_model_len=1024,
        num_kv_blocks=256,
        **options,
    )


def engine_greedy(folder: Path, prompts: list[list[int]], dtype: str, **options: Any) -> Greedy:
    """Greedy tokens of all ``prompts`` submitted at once, with the engine's top-2 gaps."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)

    async def one(eng: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        gaps: list[float] = []
        async for out in eng.stream(prompt, params):
            ids.extend(out.token_ids)
            gaps.extend(lp.logprobs[1] - lp.logprobs[2] for lp in out.logprobs or [])
        return ids, gaps

    async def main() -> Greedy:
        async with engine(folder, dtype, **options) as eng:
            results = await asyncio.gather(*(one(eng, p) for p in prompts))
            await assert_drained(eng)
        return list(results)

    return run(main(), timeout=240)


def transformers_greedy(folder: Path, prompts: list[list[int]], dtype: str) -> Greedy:
    """transformers' greedy tokens on the GPU: the whole sequence each step (no cache API,
    which moves between transformers versions; no ``generate`` EOS rules)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    model = model.to("cuda").eval()
    results: Greedy = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, gaps = list(prompt), []
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([ids], device="cuda"), use_cache=False).logits
                top = torch.log_softmax(logits[0, -1].float(), -1).topk(2)
                gaps.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
            results.append((ids[len(prompt) :], gaps))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def assert_same_greedy(got: Greedy, expected: Greedy, margin: float, what: str) -> None:
    """Equal tokens up to a divergence where ``expected`` saw a near-tie; most compared."""
    compared = 0
    for i, ((ids, _), (ref, gaps)) in enumerate(zip(got, expected, strict=True)):
        assert len(ids) == len(ref) == NEW_TOKENS, (what, i, len(ids))
        split = next((k for k, (a, b) in enumerate(zip(ids, ref, strict=True)) if a != b), None)
        if split is None:
            compared += NEW_TOKENS
            continue
        assert gaps[split] < margin, (
            f"{what}: prompt {i} parts at token {split} where the top-2 gap is "
            f"{gaps[split]:.4f} (>= {margin}): {ids[: split + 1]} vs {ref[: split + 1]}"
        )
        compared += split + 1
    assert compared >= 0.5 * NEW_TOKENS * len(got), (what, compared)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_is_the_same_in_every_mode_and_equals_transformers(
    smollm2_dir: Path, prompt_ids: list[list[int]], dtype: str
) -> None:
    margin = TIE_MARGIN[dtype]
    reference = transformers_greedy(smollm2_dir, prompt_ids, dtype)
    results = {
        mode: engine_greedy(smollm2_dir, prompt_ids, dtype, **options)
        for mode, options in MODES.items()
    }
    for mode, greedy in results.items():
        assert_same_greedy(greedy, reference, margin, f"{dtype} {mode} vs transformers")
        if mode != "eager":
            # The engine's own gaps: modes share kernels, so they part only at its near-ties.
            assert_same_greedy(greedy, results["eager"], margin, f"{dtype} {mode} vs eager")


def serving_engine(folder: Path) -> Engine:
    """A bf16 CUDA engine sized for 256 concurrent streams."""
    return Engine(
        model=str(folder),
        device="cuda",
        dtype="bfloat16",
        attention_backend="auto",
        max_num_seqs=256,
        max_model_len=1024,
        num_kv_blocks=2048,
    )


def test_256_streams_through_the_runtime_on_cuda(smollm2_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def one(eng: Engine, i: int) -> tuple[str, list[int], str | None]:
        text, ids, reason = "", [], None
        async for out in eng.stream(f"{PROMPTS[i % len(PROMPTS)]} #{i}", params):
            text += out.text
            ids.extend(out.token_ids)
            reason = out.finish_reason
        return text, ids, reason

    async def main() -> None:
        async with serving_engine(smollm2_dir) as eng:
            results = await asyncio.gather(*(one(eng, i) for i in range(256)))
            for text, ids, reason in results:
                assert len(ids) == 24 and reason == "length"
                assert text == eng.tokenizer.decode(ids, skip_special_tokens=True)
            await assert_drained(eng)

    run(main(), timeout=240)


def test_256_sse_streams_through_the_router_on_cuda(smollm2_dir: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("sse_starlette")
    httpx = pytest.importorskip("httpx")
    from inlinelm.api import openai_router

    async def one(client: Any, i: int) -> tuple[int, str | None, bool]:
        body = {
            "model": "default",
            "prompt": f"{PROMPTS[i % len(PROMPTS)]} #{i}",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        chunks, reason, done = 0, None, False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                chunks += 1
                reason = choice.get("finish_reason") or reason
        return chunks, reason, done

    async def main() -> None:
        async with serving_engine(smollm2_dir) as eng:
            transport = httpx.ASGITransport(app=openai_router(eng, model_name="default"))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://localhost", timeout=120
            ) as client:
                results = await asyncio.gather(*(one(client, i) for i in range(256)))
            for chunks, reason, done in results:
                assert chunks >= 1 and reason == "length" and done
            await assert_drained(eng)

    run(main(), timeout=240)


def test_device_memory_is_returned_on_close(smollm2_dir: Path) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    async def main() -> None:
        async with engine(smollm2_dir, "bfloat16", num_kv_blocks=1024) as eng:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outs = await asyncio.gather(*(eng.stream(p, params) for p in PROMPTS))
            assert all(len(o.token_ids) == 8 for o in outs)
            assert torch.cuda.memory_allocated() > allocated + 100 * 2**20  # weights + cache

    run(main(), timeout=240)
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() <= allocated + 8 * 2**20
    assert torch.cuda.memory_reserved() <= reserved + 64 * 2**20
