"""``POST /v1/embeddings`` (OpenAI's), ``POST /v1/rerank`` (the Cohere/Jina shape vLLM
serves) and ``POST /v1/score`` (vLLM's ``text_1``/``text_2``), for one model.

Each reads the body :meth:`~inlinelm.api.model_table.ModelTable.dispatch` parsed, checks
every field before anything is submitted (a 400 naming the field), and answers once every
input is done; the engine batches the inputs with everything else it runs. A model that
serves another task answers a 400 naming the model and what it serves.

Embeddings come as floats, or with ``encoding_format: "base64"`` as the base64 of their
little-endian float32 bytes (what the ``openai`` SDK asks for and decodes by default).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inlinelm.api.errors import bad_request
from inlinelm.api.fields import Fields
from inlinelm.api.responses import new_id
from inlinelm.api.serving import error_response, ready
from inlinelm.runtime.outputs import ScoreOutput

if TYPE_CHECKING:
    from inlinelm.api.body import JsonBody
    from inlinelm.api.serving import OpenAIServing

TASK_ENDPOINTS = {
    "generate": "/v1/chat/completions, /v1/completions",
    "embed": "/v1/embeddings",
    "score": "/v1/rerank, /v1/score",
}


class PoolingEndpoints:
    """The embeddings, rerank and score endpoints of one served model."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.engine = serving.engine
        self.model_name = serving.model_name

    async def embeddings(self, request: Request, body: JsonBody) -> Response:
        """``POST /v1/embeddings``: ``input`` (a string, strings, token ids or lists of
        them), ``encoding_format``, ``dimensions``; inlinelm's ``truncate_prompt_tokens``,
        ``normalize`` and ``prompt_name`` besides."""
        try:
            fields = Fields(body.data)
            fields.raw("model")
            fields.read_str("user", None)
            inputs = _read_input(fields)
            encoding = fields.read_str("encoding_format", "float")
            if encoding not in ("float", "base64"):
                raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
            options: dict[str, Any] = {
                "dimensions": fields.read_int("dimensions", None),
                "truncate_prompt_tokens": fields.read_int("truncate_prompt_tokens", None),
                "prompt_name": fields.read_str("prompt_name", None),
            }
            if fields.has("normalize"):
                options["normalize"] = fields.read_bool("normalize", True)
            fields.refuse_rest()
            await ready(self.engine)
            self._check_task("embed")
            outputs = await self.engine.embed(inputs, **options)
        except Exception as exc:
            return error_response(exc)
        tokens = sum(out.num_prompt_tokens for out in outputs)
        data = [
            {
                "object": "embedding",
                "index": out.index,
                "embedding": _encoded(out.embedding, encoding),
            }
            for out in outputs
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def rerank(self, request: Request, body: JsonBody) -> Response:
        """``POST /v1/rerank``: ``query``, ``documents`` (strings, or objects with
        ``text``), ``top_n``, ``return_documents``; results by relevance, best first."""
        try:
            fields = Fields(body.data)
            fields.raw("model")
            query = _required_str(fields, "query")
            documents = _read_documents(fields)
            top_n = fields.read_int("top_n", None)
            if top_n is not None and top_n < 1:
                raise bad_request("top_n must be a positive integer", "top_n")
            return_documents = fields.read_bool("return_documents", True)
            truncate = fields.read_int("truncate_prompt_tokens", None)
            instruction = fields.read_str("instruction", None)
            fields.refuse_rest()
            await ready(self.engine)
            self._check_task("score")
            scores = await self.engine.score(
                query, documents, truncate_prompt_tokens=truncate, instruction=instruction
            )
        except Exception as exc:
            return error_response(exc)
        ranked = sorted(scores, key=lambda s: (-s.score, s.index))[: top_n or len(scores)]
        results = []
        for s in ranked:
            result: dict[str, Any] = {"index": s.index, "relevance_score": s.score}
            if return_documents:
                result["document"] = {"text": documents[s.index]}
            results.append(result)
        tokens = sum(s.num_prompt_tokens for s in scores)
        return JSONResponse(
            {
                "id": new_id("rerank"),
                "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results,
            }
        )

    async def score(self, request: Request, body: JsonBody) -> Response:
        """``POST /v1/score``: ``text_1`` and ``text_2``, each a string or a list; one
        text against many, or two lists of the same length pair by pair."""
        try:
            fields = Fields(body.data)
            fields.raw("model")
            pairs = _read_pairs(fields)
            truncate = fields.read_int("truncate_prompt_tokens", None)
            fields.refuse_rest()
            await ready(self.engine)
            self._check_task("score")
            scores = await self._score_pairs(pairs, truncate)
        except Exception as exc:
            return error_response(exc)
        tokens = sum(s.num_prompt_tokens for s in scores)
        return JSONResponse(
            {
                "id": new_id("score"),
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": [
                    {"index": i, "object": "score", "score": s.score} for i, s in enumerate(scores)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def _score_pairs(
        self, pairs: list[tuple[str, str]], truncate: int | None
    ) -> list[ScoreOutput]:
        """Each pair's score: one ``Engine.score`` per distinct first text, run together."""
        by_query: dict[str, list[int]] = {}
        for i, (query, _) in enumerate(pairs):
            by_query.setdefault(query, []).append(i)
        queries = list(by_query)
        results = await asyncio.gather(
            *(
                self.engine.score(
                    q, [pairs[i][1] for i in by_query[q]], truncate_prompt_tokens=truncate
                )
                for q in queries
            )
        )
        scores: list[ScoreOutput | None] = [None] * len(pairs)
        for query, found in zip(queries, results, strict=True):
            for i, s in zip(by_query[query], found, strict=True):
                scores[i] = s
        return [s for s in scores if s is not None]

    def _check_task(self, task: str) -> None:
        served = self.engine.task
        if served != task:
            raise bad_request(
                f"the model `{self.model_name}` does not serve this endpoint: it serves "
                f"{served} (task={served!r}: {TASK_ENDPOINTS[served]})",
                "model",
                code="model_not_supported",
            )


def _read_input(fields: Fields) -> str | list[int] | list[str] | list[list[int]]:
    value = fields.raw("input")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return value
        if all(_is_int(v) for v in value):
            return value
        if all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
            return value
    raise bad_request(
        "input must be a non-empty string, list of strings, list of token ids, or list of "
        "token-id lists",
        "input",
        code="invalid_type",
    )


def _required_str(fields: Fields, key: str) -> str:
    value = fields.read_str(key, None)
    if value is None:
        raise bad_request(f"{key} is required", key, code="missing_required_parameter")
    return value


def _read_documents(fields: Fields) -> list[str]:
    value = fields.raw("documents")
    if not isinstance(value, list) or not value:
        raise bad_request("documents must be a non-empty list", "documents", code="invalid_type")
    out = []
    for i, doc in enumerate(value):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise bad_request(
                f"documents[{i}] must be a string or an object with a string 'text'",
                f"documents[{i}]",
                code="invalid_type",
            )
        out.append(text)
    return out


def _read_pairs(fields: Fields) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against a list, a one-item list broadcast, or two lists
    of one length pair by pair."""
    sides = []
    for key in ("text_1", "text_2"):
        value = fields.raw(key)
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request(
                f"{key} must be a string or a non-empty list of strings", key, code="invalid_type"
            )
        sides.append(texts)
    first, second = sides
    if len(first) == 1:
        first = first * len(second)
    if len(second) == 1:
        second = second * len(first)
    if len(first) != len(second):
        raise bad_request(
            f"text_1 and text_2 must have one length, or one of them a single text "
            f"(got {len(sides[0])} and {len(sides[1])})",
            "text_2",
        )
    return list(zip(first, second, strict=True))


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
