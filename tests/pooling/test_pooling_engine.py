"""``Engine.embed`` and ``Engine.score`` against sentence-transformers and transformers:
encoder and decoder embedders (CLS, mean and last-token pooling, prompts, Matryoshka
dimensions), cross-encoders and a decoder reranker; batched with mixed lengths, a decoder's
prompts chunked; bad input refused before anything is submitted; nothing left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import ConfigError, Engine, RequestError
from tests.helpers import core_of
from tests.pooling import builders
from tests.runtime.helpers import run

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog and then it runs into the woods far away",
    "a",
    "she sells sea shells by the sea shore " * 3,
]


def atol_for(folder: Path, reference: torch.Tensor) -> float:
    """How far our float32 results may stray from the reference's: each layer's matmuls
    sum ~hidden products, so another summation order moves a value by ~sqrt(hidden)
    roundings of relative size eps; the residual stream carries every layer's error on,
    and the values' own size scales it (as ``tests.gpu.reference.logits_atol``). A 2x
    margin covers the pooling's own sum (mean) and the normalisation."""
    import json

    raw = json.loads((folder / "config.json").read_text())
    eps = torch.finfo(torch.float32).eps
    scale = max(reference.abs().max().item(), 1.0)
    return 2 * eps * raw["num_hidden_layers"] * raw["hidden_size"] ** 0.5 * scale


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-models")
    return {
        "bert-cls": builders.make_bert(
            root / "bert-cls", sentence_transformers="cls", normalize=True
        ),
        "bert-mean": builders.make_bert(root / "bert-mean", sentence_transformers="mean"),
        "xlm-roberta": builders.make_xlm_roberta(
            root / "xlmr", sentence_transformers="mean", normalize=True
        ),
        "modernbert": builders.make_modernbert(root / "mbert", sentence_transformers="mean"),
        "qwen3": builders.make_qwen3_embedder(root / "qwen3"),
        "cross": builders.make_bert_cross_encoder(root / "cross"),
        "reranker": builders.make_qwen3_reranker(root / "reranker"),
    }


def _st(folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


def _embed(folder: Path, call: Callable[[Engine], Any], **options: Any) -> Any:
    async def main() -> Any:
        async with Engine(model=str(folder), **options) as engine:
            result = await call(engine)
            core = core_of(engine)
            # NOTE: nothing is left behind: every request finished and freed its blocks
            assert not core.scheduler.has_unfinished_requests()
            assert core.scheduler.num_used_blocks == 0
            return result

    return run(main())


@pytest.mark.parametrize("name", ["bert-cls", "bert-mean", "xlm-roberta", "modernbert", "qwen3"])
def test_embeddings_equal_sentence_transformers_in_one_ragged_batch(
    models: dict[str, Path], name: str
) -> None:
    folder = models[name]
    expected = _st(folder).encode(TEXTS, convert_to_tensor=True)
    # a small token budget chunks the decoder's longer prompts over several steps
    outs = _embed(folder, lambda e: e.embed(TEXTS), max_num_batched_tokens=16)
    got = torch.tensor([o.embedding for o in outs])
    assert [o.index for o in outs] == list(range(len(TEXTS)))
    torch.testing.assert_close(got, expected, rtol=0, atol=atol_for(folder, expected))


def test_token_ids_and_options_of_an_embedding(models: dict[str, Path]) -> None:
    folder = models["bert-mean"]
    st = _st(folder)
    ids = st.tokenizer(TEXTS[1])["input_ids"]
    raw = st.encode([TEXTS[1]], convert_to_tensor=True)[0]
    query = st.encode([TEXTS[0]], prompt_name="query", convert_to_tensor=True)[0]

    async def call(engine: Engine) -> Any:
        by_ids = await engine.embed(ids)
        # NOTE: this model does not normalise (no Normalize module); a cut is renormalised
        cut = await engine.embed(TEXTS[1], dimensions=8)
        raw_cut = await engine.embed(TEXTS[1], dimensions=8, normalize=False)
        prompted = await engine.embed(TEXTS[0], prompt_name="query")
        return by_ids[0], cut[0], prompted[0], raw_cut[0]

    by_ids, cut, prompted, raw_cut = _embed(folder, call)
    atol = atol_for(folder, raw)
    torch.testing.assert_close(torch.tensor(by_ids.embedding), raw, rtol=0, atol=atol)
    assert by_ids.num_prompt_tokens == len(ids)
    want = torch.nn.functional.normalize(raw[:8], dim=0)
    torch.testing.assert_close(torch.tensor(cut.embedding), want, rtol=0, atol=atol * 4)
    torch.testing.assert_close(torch.tensor(raw_cut.embedding), raw[:8], rtol=0, atol=atol)
    torch.testing.assert_close(torch.tensor(prompted.embedding), query, rtol=0, atol=atol)


def test_truncate_prompt_tokens_equals_the_tokenizers_cut(models: dict[str, Path]) -> None:
    folder = models["bert-cls"]
    st = _st(folder)
    st.max_seq_length = 6
    expected = st.encode([TEXTS[1]], convert_to_tensor=True)[0]
    long = TEXTS[1] * 20  # past the model's 128 tokens

    async def call(engine: Engine) -> Any:
        with pytest.raises(RequestError, match="maximum input length is 128"):
            await engine.embed(["ok", long])
        return (await engine.embed(TEXTS[1], truncate_prompt_tokens=6))[0]

    out = _embed(folder, call)
    assert out.num_prompt_tokens == 6
    torch.testing.assert_close(
        torch.tensor(out.embedding), expected, rtol=0, atol=atol_for(folder, expected)
    )


def test_cross_encoder_scores_equal_transformers_sigmoid(models: dict[str, Path]) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = models["cross"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    enc = tok(["where is the fox"] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(model(**enc).logits[:, 0])
    outs = _embed(folder, lambda e: e.score("where is the fox", TEXTS))
    got = torch.tensor([o.score for o in outs])
    torch.testing.assert_close(got, expected, rtol=0, atol=atol_for(folder, expected))


def test_decoder_reranker_scores_the_answer_tokens(models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inlinelm.runtime.pooler_config import RERANKER_INSTRUCTION
    from inlinelm.runtime.pooling_inputs import RERANKER_PREFIX, RERANKER_SUFFIX

    folder = models["reranker"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    expected = []
    for doc in TEXTS:
        text = (
            f"{RERANKER_PREFIX}<Instruct>: {RERANKER_INSTRUCTION}\n<Query>: fox\n"
            f"<Document>: {doc}{RERANKER_SUFFIX}"
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(logits[[no, yes]], dim=0)[1])
    want = torch.stack(expected)
    outs = _embed(folder, lambda e: e.score("fox", TEXTS), task="score", max_num_batched_tokens=32)
    got = torch.tensor([o.score for o in outs])
    torch.testing.assert_close(got, want, rtol=0, atol=atol_for(folder, want))


def test_many_concurrent_embeds_batch_and_each_gets_its_own(models: dict[str, Path]) -> None:
    folder = models["modernbert"]
    texts = [f"{TEXTS[i % 4]} {i}" for i in range(24)]

    async def call(engine: Engine) -> Any:
        alone = [(await engine.embed(t))[0].embedding for t in texts]
        together = await asyncio.gather(*(engine.embed(t) for t in texts))
        return alone, [o[0].embedding for o in together]

    alone, together = _embed(folder, call)
    got, want = torch.tensor(together), torch.tensor(alone)
    torch.testing.assert_close(got, want, rtol=0, atol=atol_for(folder, want))


def test_wrong_tasks_and_bad_input_are_refused(
    models: dict[str, Path], tiny_model_dir: Path
) -> None:
    async def chat_model() -> None:
        async with Engine(model=str(tiny_model_dir)) as engine:
            with pytest.raises(RequestError, match="serves text generation") as info:
                await engine.embed("hello")
            assert info.value.param == "model"

    run(chat_model())

    async def embedder(engine: Engine) -> None:
        with pytest.raises(RequestError, match="serves embeddings"):
            await engine.stream("hello")
        with pytest.raises(RequestError, match="serves embeddings"):
            await engine.score("q", ["d"])
        with pytest.raises(RequestError, match="dimensions"):
            await engine.embed("x", dimensions=33)
        with pytest.raises(RequestError, match="unknown prompt_name"):
            await engine.embed("x", prompt_name="nope")
        with pytest.raises(RequestError, match="input"):
            await engine.embed([])
        with pytest.raises(RequestError, match="token ids must be in"):
            await engine.embed([[1, 2], [10**6]])
        with pytest.raises(RequestError, match="truncate_prompt_tokens"):
            await engine.embed("x", truncate_prompt_tokens=0)

    _embed(models["bert-cls"], embedder)
    with pytest.raises(ConfigError, match="it serves embed"):
        run(Engine(model=str(models["bert-cls"]), task="generate").start())
    with pytest.raises(ConfigError, match="it serves score"):
        run(Engine(model=str(models["cross"]), task="embed").start())


def test_a_bare_decoder_saved_without_its_lm_head_embeds(tmp_path: Path) -> None:
    """Qwen3-Embedding's layout: the inner ``Qwen3Model`` saved (names without
    ``model.``, no ``lm_head``), tied embeddings, sentence-transformers files."""
    from transformers import Qwen3ForCausalLM

    causal = builders.make_qwen3_embedder(tmp_path / "causal")
    bare = tmp_path / "bare"
    Qwen3ForCausalLM.from_pretrained(str(causal)).model.save_pretrained(str(bare))
    for path in causal.iterdir():
        if not (bare / path.name).exists():
            if path.is_dir():
                import shutil

                shutil.copytree(path, bare / path.name)
            else:
                (bare / path.name).write_bytes(path.read_bytes())
    expected = _st(causal).encode(TEXTS, convert_to_tensor=True)
    outs = _embed(bare, lambda e: e.embed(TEXTS))
    got = torch.tensor([o.embedding for o in outs])
    torch.testing.assert_close(got, expected, rtol=0, atol=atol_for(causal, expected))
