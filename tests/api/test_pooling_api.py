"""``/v1/embeddings``, ``/v1/rerank`` and ``/v1/score`` over HTTP, and completions' ``echo``
with ``logprobs`` (the prompt's logprobs): the ``openai`` SDK's embeddings unchanged (float
and base64), the Cohere/Jina rerank shape, vLLM's score pairs, and every bad request a 400
before anything is submitted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from inlinelm import Engine, SamplingParams
from inlinelm.api import create_app
from tests.api.conftest import ServerThread, openai_client, serve
from tests.pooling import builders
from tests.pooling.test_pooling_engine import atol_for

DOCS = ["the fox jumps over the dog", "a lazy afternoon", "fox", "rain on the sea shore"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-api")
    return {
        "embedder": builders.make_bert(root / "e", sentence_transformers="mean", normalize=True),
        "reranker": builders.make_bert_cross_encoder(root / "r"),
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], tiny_model_dir: Path) -> Iterator[ServerThread]:
    app = create_app(
        {
            "chat": Engine(model=str(tiny_model_dir)),
            "embedder": Engine(model=str(folders["embedder"])),
            "reranker": Engine(model=str(folders["reranker"])),
        }
    )
    yield from serve(app)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai_client(server.url) as c:
        yield c


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _expected(folder: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)


def test_the_openai_sdk_embeds_as_floats_and_as_base64(
    client: openai.OpenAI, folders: dict[str, Path]
) -> None:
    expected = _expected(folders["embedder"], DOCS)
    atol = atol_for(folders["embedder"], expected)
    # the SDK asks for base64 unless told, and decodes it itself
    for encoding in ("base64", "float"):
        kwargs: dict[str, Any] = {} if encoding == "base64" else {"encoding_format": "float"}
        reply = client.embeddings.create(model="embedder", input=DOCS, **kwargs)
        assert reply.model == "embedder" and [d.index for d in reply.data] == [0, 1, 2, 3]
        got = torch.tensor([d.embedding for d in reply.data])
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(DOCS)


def test_embedding_inputs_as_token_ids_and_dimensions(
    client: openai.OpenAI, server: ServerThread
) -> None:
    one = client.embeddings.create(model="embedder", input=DOCS[0], encoding_format="float")
    ids = post(server, "/tokenize", {"model": "embedder", "prompt": DOCS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model="embedder", input=ids, encoding_format="float")
    lists = client.embeddings.create(
        model="embedder", input=[ids, ids[:3]], encoding_format="float"
    )
    assert by_ids.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == len(ids) + 3
    cut = client.embeddings.create(
        model="embedder", input=DOCS[0], dimensions=8, encoding_format="float"
    )
    assert len(cut.data[0].embedding) == 8
    assert sum(v * v for v in cut.data[0].embedding) == pytest.approx(1.0, abs=1e-5)


def test_rerank_orders_by_the_cross_encoders_scores(
    server: ServerThread, folders: dict[str, Path]
) -> None:
    from sentence_transformers import CrossEncoder

    scores = CrossEncoder(str(folders["reranker"]), device="cpu").predict(
        [("where is the fox", d) for d in DOCS]
    )
    reply = post(
        server,
        "/v1/rerank",
        {"model": "reranker", "query": "where is the fox", "documents": DOCS, "top_n": 3},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    results = body["results"]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in results] == order
    for r in results:
        assert r["relevance_score"] == pytest.approx(float(scores[r["index"]]), abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    bare = post(
        server,
        "/v1/rerank",
        {
            "model": "reranker",
            "query": "q",
            "documents": [{"text": d} for d in DOCS],
            "return_documents": False,
        },
    ).json()
    assert len(bare["results"]) == 4 and all("document" not in r for r in bare["results"])
    assert body["usage"]["total_tokens"] > 0


def test_score_pairs_one_against_many_and_pair_by_pair(server: ServerThread) -> None:
    many = post(server, "/v1/score", {"model": "reranker", "text_1": "fox", "text_2": DOCS}).json()
    pairs = post(
        server, "/v1/score", {"model": "reranker", "text_1": ["fox"] * 4, "text_2": DOCS}
    ).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2, 3]
    assert [d["score"] for d in many["data"]] == pytest.approx([d["score"] for d in pairs["data"]])
    mixed = post(
        server, "/v1/score", {"model": "reranker", "text_1": ["fox", "sea"], "text_2": DOCS[:2]}
    ).json()
    assert mixed["data"][0]["score"] == pytest.approx(many["data"][0]["score"])
    bad = post(server, "/v1/score", {"model": "reranker", "text_1": ["a", "b"], "text_2": DOCS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": "embedder", "input": []}, "input"),
        ("/v1/embeddings", {"model": "embedder", "input": [1, "a"]}, "input"),
        (
            "/v1/embeddings",
            {"model": "embedder", "input": "x", "encoding_format": "f16"},
            "encoding_format",
        ),
        ("/v1/embeddings", {"model": "embedder", "input": "x", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"model": "embedder", "input": "x", "stream": True}, "stream"),
        ("/v1/embeddings", {"model": "embedder", "input": "word " * 400}, "input"),
        ("/v1/embeddings", {"model": "chat", "input": "x"}, "model"),
        ("/v1/rerank", {"model": "embedder", "query": "q", "documents": ["d"]}, "model"),
        ("/v1/rerank", {"model": "reranker", "documents": ["d"]}, "query"),
        ("/v1/rerank", {"model": "reranker", "query": "q", "documents": [3]}, "documents[0]"),
        (
            "/v1/rerank",
            {"model": "reranker", "query": "q", "documents": ["d"], "top_n": 0},
            "top_n",
        ),
        ("/v1/score", {"model": "reranker", "text_1": "q"}, "text_2"),
    ],
)
def test_bad_pooling_requests_are_400s_naming_the_field(
    server: ServerThread, path: str, body: dict[str, Any], param: str
) -> None:
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    if param == "model":
        assert f"`{body['model']}`" in error["message"] and "serves" in error["message"]


def test_a_long_input_is_cut_with_truncate_prompt_tokens(server: ServerThread) -> None:
    reply = post(
        server,
        "/v1/embeddings",
        {"model": "embedder", "input": "word " * 400, "truncate_prompt_tokens": 16},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 16


def test_completions_echo_with_logprobs_lead_with_the_prompt(
    server: ServerThread, client: openai.OpenAI, tiny_model_dir: Path, tokenizer: Any
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer(prompt)["input_ids"]

    async def reference() -> Any:
        async with Engine(model=str(tiny_model_dir)) as engine:
            return await engine.stream(
                prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=1)
            )

    import asyncio

    want = asyncio.run(reference())
    for stream in (False, True):
        body = {
            "model": "chat",
            "prompt": prompt,
            "max_tokens": 3,
            "temperature": 0,
            "echo": True,
            "logprobs": 1,
            "stream": stream,
        }
        if stream:
            text, tokens, lps = "", [], []
            for chunk in client.completions.create(**body):
                for choice in chunk.choices:
                    text += choice.text
                    if choice.logprobs is not None:
                        tokens += choice.logprobs.tokens or []
                        lps += choice.logprobs.token_logprobs or []
        else:
            reply = client.completions.create(**body)
            (choice,) = reply.choices
            text = choice.text
            assert choice.logprobs is not None
            tokens, lps = choice.logprobs.tokens or [], choice.logprobs.token_logprobs or []
        assert text == prompt + want.text
        assert len(tokens) == len(ids) + 3 and lps[0] is None
        expected = [e.logprobs[0] for e in want.prompt_logprobs[1:]]
        expected += [e.logprobs[0] for e in want.outputs[0].logprobs]
        assert lps[1:] == pytest.approx(expected, abs=1e-5)
    vllm = post(
        server,
        "/v1/completions",
        {"model": "chat", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2},
    ).json()
    entries = vllm["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert str(ids[1]) in entries[1] and entries[1][str(ids[1])]["rank"] >= 1
