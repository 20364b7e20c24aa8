"""The pooling half of the public ``Engine``: embeddings and scores (event loop)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from inlinelm.errors import RequestError
from inlinelm.runtime.engine_base import EngineBase
from inlinelm.runtime.loader import LoadedEngine
from inlinelm.runtime.outputs import EmbeddingOutput, RequestOutput, ScoreOutput
from inlinelm.runtime.pooling_inputs import (
    EmbedInput,
    EmbedOptions,
    PooledInput,
    embed_inputs,
    input_batch,
    score_inputs,
)
from inlinelm.runtime.prompt_source import PromptSource
from inlinelm.runtime.stream import RequestStream
from inlinelm.runtime.submission import check_task
from inlinelm.runtime.sync import generate_all, run_sync
from inlinelm.sampling_params import OutputKind, SamplingParams


class EnginePooling(EngineBase):
    """``embed`` and ``score`` (and their sync twins) of an engine whose task is
    ``"embed"`` or ``"score"``; an engine of another task refuses them with a
    ``RequestError`` naming what it serves."""

    @property
    def task(self) -> str:
        """What the started engine serves: "generate", "embed" or "score" (the ``task``
        option resolved against the model)."""
        return self._submitter.require_loaded().task

    async def embed(
        self,
        inputs: EmbedInput | Sequence[EmbedInput],
        *,
        prompt_name: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> list[EmbeddingOutput]:
        """The embedding of each input (a string or token ids; one, or a list of them), in
        order, batched with every other request of the engine.

        Texts get the model's prompt first: ``prompt_name`` names one of its
        sentence-transformers prompts (default: its default prompt, if any).
        ``normalize`` overrides the model's L2 normalisation; ``dimensions`` keeps the
        first values of each vector (Matryoshka), renormalised after the cut (unless
        ``normalize=False``).
        ``truncate_prompt_tokens`` cuts longer inputs to that many tokens (-1: the model's
        longest); without it an input that does not fit is a ``RequestError``, and no
        input of the call is submitted.
        """
        batch = input_batch(inputs)
        options = EmbedOptions(prompt_name, normalize, dimensions, truncate_prompt_tokens)
        prepared = await self._submitter.prepare(
            functools.partial(_embed_inputs, batch, options), _size(batch)
        )
        outputs = await self._pool(prepared, priority)
        return [
            EmbeddingOutput(i, _pooled(out), len(item.token_ids))
            for i, (item, out) in enumerate(zip(prepared, outputs, strict=True))
        ]

    async def score(
        self,
        query: str,
        documents: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        instruction: str | None = None,
        priority: int = 0,
    ) -> list[ScoreOutput]:
        """The relevance of each document to ``query``, in the documents' order, each in
        [0, 1] (a reranker's: sort them yourself, or use ``POST /v1/rerank``).

        A cross-encoder reads each (query, document) pair; a decoder reranker
        (``task="score"`` on a causal LM: Qwen3-Reranker) reads them in its prompt, with
        ``instruction`` as its task (default: web-search relevance).
        ``truncate_prompt_tokens`` as in :meth:`embed`.
        """
        docs = [documents] if isinstance(documents, str) else list(documents)
        if not isinstance(query, str) or not all(isinstance(d, str) for d in docs):
            raise RequestError("query and documents must be strings", param="documents")
        if not docs:
            raise RequestError("documents is empty", param="documents")
        prepare = functools.partial(_score_inputs, query, docs, truncate_prompt_tokens, instruction)
        size = len(query) * len(docs) + sum(map(len, docs))
        prepared = await self._submitter.prepare(prepare, size)
        outputs = await self._pool(prepared, priority)
        return [
            ScoreOutput(i, _pooled(out)[0], len(item.token_ids))
            for i, (item, out) in enumerate(zip(prepared, outputs, strict=True))
        ]

    def embed_sync(
        self, inputs: EmbedInput | Sequence[EmbedInput], **options: object
    ) -> list[EmbeddingOutput]:
        """:meth:`embed`, waited for: from a script, any thread, or a Jupyter cell (as
        :meth:`~inlinelm.Engine.generate`)."""
        return run_sync(self.embed(inputs, **options))  # type: ignore[arg-type]  # checked there

    def score_sync(
        self, query: str, documents: str | Sequence[str], **options: object
    ) -> list[ScoreOutput]:
        """:meth:`score`, waited for (as :meth:`embed_sync`)."""
        return run_sync(self.score(query, documents, **options))  # type: ignore[arg-type]  # checked there

    async def _pool(self, prepared: list[PooledInput], priority: int) -> list[RequestOutput]:
        """Submit every input (all checked already) and await their results together;
        a failure aborts the rest."""
        params = _pooling_params(priority)

        def open_stream(item: PooledInput) -> RequestStream:
            source = PromptSource.of_prompt(item.token_ids, False, len(item.token_ids))
            return self._submitter.open(source, params, None, None, pooling=item.pooling)

        return await generate_all(self.start, prepared, open_stream, use_tqdm=False)


def _pooling_params(priority: int) -> SamplingParams:
    """A pooling request's params: one (unused) greedy token, the final output only."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        output_kind=OutputKind.FINAL_ONLY,
        priority=priority,
    )


def _embed_inputs(
    batch: list[EmbedInput], options: EmbedOptions, loaded: LoadedEngine
) -> list[PooledInput]:
    check_task(loaded, "embed")
    return embed_inputs(loaded, batch, options)


def _score_inputs(
    query: str,
    docs: list[str],
    truncate: int | None,
    instruction: str | None,
    loaded: LoadedEngine,
) -> list[PooledInput]:
    check_task(loaded, "score")
    return score_inputs(loaded, query, docs, truncate, instruction)


def _pooled(out: RequestOutput) -> list[float]:
    assert out.pooled is not None, "a pooling request finishes with its result"
    return out.pooled


def _size(batch: list[EmbedInput]) -> int:
    return sum(len(item) for item in batch)
