"""A pooling request's inputs made into token ids and a pooling (event loop or a
tokenizer worker thread).

Embeddings: each text gets the embedder's prompt first (a named one of its
sentence-transformers config, or its default), and is tokenized with its special tokens;
token-id inputs are taken as they are. Scores: a cross-encoder reads (query, document) as
a tokenizer pair, with its segment ids; a decoder reranker reads the pair in its prompt
(Qwen3-Reranker's) and answers "yes" or "no". ``truncate_prompt_tokens`` cuts an input to
that many tokens (-1: the model's longest) instead of refusing it: a text is cut by the
tokenizer, which keeps its special tokens; a document in a decoder reranker's prompt loses
its end, not the prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from inlinelm.errors import RequestError
from inlinelm.runtime.loader import LoadedEngine
from inlinelm.runtime.pooler_config import RERANKER_INSTRUCTION
from inlinelm.sched.pooling import Pooling

EmbedInput = str | Sequence[int]

RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True, slots=True)
class PooledInput:
    """One pooling request, ready to submit."""

    token_ids: list[int]
    pooling: Pooling


@dataclass(frozen=True, slots=True)
class EmbedOptions:
    """A request's embedding options (see ``Engine.embed``)."""

    prompt_name: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None


def input_batch(inputs: EmbedInput | Sequence[EmbedInput]) -> list[EmbedInput]:
    """One input (a string or token ids) or a list of them, as a list; a ``RequestError``
    for anything else, or for none."""
    if isinstance(inputs, str) or _is_ids(inputs):
        return [cast(EmbedInput, inputs)]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes):
        raise RequestError("input must be a string, token ids, or a list of either", param="input")
    items: list[EmbedInput] = []
    for item in inputs:
        if not isinstance(item, str) and not _is_ids(item):
            raise RequestError(
                "input must be a string, token ids, or a list of either", param="input"
            )
        items.append(cast(EmbedInput, item))
    if not items:
        raise RequestError("input is empty", param="input")
    return items


def embed_inputs(
    loaded: LoadedEngine, inputs: list[EmbedInput], options: EmbedOptions
) -> list[PooledInput]:
    """Token ids and pooling of each input to embed."""
    pooler = loaded.pooler
    assert pooler is not None and pooler.task == "embed"
    dimensions = _dimensions(options.dimensions, pooler.dimensions)
    normalize = options.normalize
    if normalize is None:
        # NOTE: a Matryoshka cut is renormalised unless the request says otherwise
        normalize = pooler.normalize or dimensions is not None
    pooling = Pooling("embed", pooler.method, normalize, dimensions)
    prefix = _prompt(pooler.prompts, pooler.default_prompt, options.prompt_name)
    limit = _limit(loaded, options.truncate_prompt_tokens)
    texts = [i for i, item in enumerate(inputs) if isinstance(item, str)]
    encoded = _encode(loaded.tokenizer, [prefix + str(inputs[i]) for i in texts], None, limit)
    ids: list[list[int]] = [list(item) if not isinstance(item, str) else [] for item in inputs]
    for i, (token_ids, _) in zip(texts, encoded, strict=True):
        ids[i] = token_ids
    out = []
    for i, token_ids in enumerate(ids):
        if not isinstance(inputs[i], str) and limit is not None:
            token_ids = token_ids[:limit]
        _check_ids(token_ids, loaded, i)
        out.append(PooledInput(token_ids, pooling))
    return out


def score_inputs(
    loaded: LoadedEngine,
    query: str,
    documents: list[str],
    truncate_prompt_tokens: int | None,
    instruction: str | None,
) -> list[PooledInput]:
    """Token ids and pooling of each (query, document) pair to score."""
    limit = _limit(loaded, truncate_prompt_tokens)
    if loaded.token_pair is None:
        encoded = _encode(loaded.tokenizer, [query] * len(documents), documents, limit)
        pooling = Pooling("classify")
        pairs = [PooledInput(ids, replace(pooling, token_type_ids=types)) for ids, types in encoded]
    else:
        pairs = _reranker_prompts(loaded, query, documents, limit, instruction)
    for i, pair in enumerate(pairs):
        _check_ids(pair.token_ids, loaded, i)
    return pairs


def _reranker_prompts(
    loaded: LoadedEngine,
    query: str,
    documents: list[str],
    limit: int | None,
    instruction: str | None,
) -> list[PooledInput]:
    """A decoder reranker's prompt per document: the document cut when the prompt would
    pass ``limit``."""
    tokenizer = loaded.tokenizer
    head = f"{RERANKER_PREFIX}<Instruct>: {instruction or RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: "
    head_ids = _plain(tokenizer, head)
    tail_ids = _plain(tokenizer, RERANKER_SUFFIX)
    pooling = Pooling("token_pair", token_pair=loaded.token_pair)
    out = []
    for document in documents:
        ids = _plain(tokenizer, head + document + RERANKER_SUFFIX)
        if limit is not None and len(ids) > limit:
            # NOTE: tokenized apart only to cut: pieces may split where the whole would not
            doc_ids = _plain(tokenizer, document)
            ids = head_ids + doc_ids[: max(0, limit - len(head_ids) - len(tail_ids))] + tail_ids
        out.append(PooledInput(ids, pooling))
    return out


def _encode(
    tokenizer: Any, texts: list[str], pairs: list[str] | None, limit: int | None
) -> list[tuple[list[int], tuple[int, ...] | None]]:
    """Token ids (and segment ids of pairs) of ``texts`` in one tokenizer call."""
    if not texts:
        return []
    try:
        enc = tokenizer(
            texts,
            pairs,
            add_special_tokens=True,
            truncation=limit is not None,
            max_length=limit,
            return_token_type_ids=pairs is not None,
        )
    except (TypeError, ValueError, UnicodeError) as e:
        raise RequestError(f"cannot tokenize the input: {type(e).__name__}", param="input") from e
    types = enc.get("token_type_ids") if pairs is not None else None
    return [
        (list(ids), None if types is None else tuple(types[i]))
        for i, ids in enumerate(enc["input_ids"])
    ]


def _plain(tokenizer: Any, text: str) -> list[int]:
    try:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, ValueError, UnicodeError) as e:
        raise RequestError(f"cannot tokenize the input: {type(e).__name__}", param="input") from e
    return ids


def _prompt(prompts: dict[str, str], default: str | None, name: str | None) -> str:
    if name is None:
        return prompts.get(default, "") if default is not None else ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise RequestError(
            f"unknown prompt_name {name!r}; this model's prompts: {known}", param="prompt_name"
        )
    return prompts[name]


def _dimensions(dimensions: int | None, size: int) -> int | None:
    if dimensions is None:
        return None
    if (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= size
    ):
        raise RequestError(
            f"dimensions must be an int in [1, {size}] (this model's embedding size)",
            param="dimensions",
        )
    return dimensions


def _limit(loaded: LoadedEngine, truncate: int | None) -> int | None:
    if truncate is None:
        return None
    if (
        isinstance(truncate, bool)
        or not isinstance(truncate, int)
        or truncate == 0
        or truncate < -1
    ):
        raise RequestError(
            "truncate_prompt_tokens must be a positive int, or -1 for the model's longest input",
            param="truncate_prompt_tokens",
        )
    return loaded.max_pooled_tokens if truncate == -1 else min(truncate, loaded.max_pooled_tokens)


def _check_ids(ids: list[int], loaded: LoadedEngine, index: int) -> None:
    if not ids:
        raise RequestError(f"input {index} is empty", param="input")
    vocab = loaded.admission.vocab_size
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
        raise RequestError(f"input {index}: token ids must be in [0, {vocab})", param="input")
    limit = loaded.max_pooled_tokens
    if len(ids) > limit:
        raise RequestError(
            f"input {index} has {len(ids)} tokens; this model's maximum input length is "
            f"{limit} tokens (set truncate_prompt_tokens to cut it)",
            param="input",
        )


def _is_ids(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
