"""What a pooling model serves and how, read from its folder (loader thread).

An embedder's pooling comes from its sentence-transformers files when it has them
(``modules.json``: the Pooling module's ``1_Pooling/config.json`` and whether a Normalize
module follows; ``config_sentence_transformers.json``: the named prompts put before
inputs; ``sentence_bert_config.json``: the longest input), else from the model's kind: an
encoder pools its first token (BERT's CLS), a decoder its last (Qwen3-Embedding's
``<|endoftext|>``). A scorer is an encoder with a sequence-classification head (a
cross-encoder) or a decoder reranker that answers "yes" or "no" (Qwen3-Reranker).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError, ModelLoadError
from inlinelm.sched.pooling import PoolingMethod

ST_MODULE = "sentence_transformers.models."
_POOLING_MODES: dict[str, PoolingMethod] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
RERANKER_ANSWERS = ("yes", "no")
"""The answer tokens a decoder reranker's score compares (Qwen3-Reranker's)."""

RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""A decoder reranker's default task instruction (Qwen3-Reranker's)."""


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """A pooling engine's task and defaults.

    ``task`` is ``"embed"`` or ``"score"``; ``method``/``normalize`` an embedder's pooling;
    ``prompts`` its named prompts (``default_prompt`` the one inputs get unless a request
    names another); ``max_input_tokens`` the longest input it takes (None: the context);
    ``classifier``: scores come from a classification head (else from the answer
    tokens); ``num_labels`` its outputs.
    """

    task: str
    method: PoolingMethod = "last"
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    max_input_tokens: int | None = None
    classifier: bool = False
    num_labels: int = 1
    dimensions: int = 0  # an embedding's size (the model's hidden size)


def resolve_task(config: EngineConfig, folder: Path, *, encoder: bool, classifier: bool) -> str:
    """The task the engine serves: the ``task`` option checked against the model, or the
    folder's (``"auto"``). A ``ConfigError`` names what the model can serve instead."""
    sentence_transformers = (folder / "modules.json").is_file()
    can: tuple[str, ...]
    if encoder:
        can = ("score",) if classifier else ("embed",)
        auto = can[0]
    else:
        can = ("generate", "embed", "score")
        auto = "embed" if sentence_transformers else "generate"
    task = auto if config.task == "auto" else config.task
    if task not in can:
        kind = "a cross-encoder" if classifier else "an encoder" if encoder else "a decoder"
        raise ConfigError(
            f"task={task!r}, but {folder} is {kind}: it serves {' or '.join(can)}",
            option="task",
        )
    return task


def read_pooler_config(
    config: EngineConfig,
    folder: Path,
    task: str,
    *,
    encoder: bool,
    hidden_size: int,
    num_labels: int = 1,
) -> PoolerConfig | None:
    """The pooling of an ``"embed"`` or ``"score"`` engine (None for ``"generate"``)."""
    if task == "generate":
        return None
    if task == "score" and encoder and num_labels != 1:
        raise ModelLoadError(
            f"a scorer gives one score per pair, but this classifier has {num_labels} labels",
            path=str(folder / "config.json"),
        )
    st = _sentence_transformers(folder)
    prompts = _prompts(folder)
    default = prompts.pop("\0default", None)
    max_input = _max_seq_length(folder)
    if task == "score":
        return PoolerConfig(
            "score",
            max_input_tokens=max_input,
            classifier=encoder,
            num_labels=num_labels,
            dimensions=hidden_size,
        )
    method: PoolingMethod = st[0] if st is not None else ("cls" if encoder else "last")
    normalize = st[1] if st is not None else not encoder
    if config.pooling != "auto":
        method = config.pooling
    return PoolerConfig(
        "embed", method, normalize, prompts, default, max_input, dimensions=hidden_size
    )


def _sentence_transformers(folder: Path) -> tuple[PoolingMethod, bool] | None:
    """The Pooling module's method and whether a Normalize module follows it, from
    ``modules.json`` (None: not a sentence-transformers folder)."""
    modules = _json(folder / "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list):
        raise ModelLoadError(
            "modules.json is not a list of modules", path=str(folder / "modules.json")
        )
    method: PoolingMethod | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        name = kind.removeprefix(ST_MODULE)
        if name == "Pooling":
            method = _pooling_method(folder / str(module.get("path", "")) / "config.json")
        elif name == "Normalize":
            normalize = True
        elif name not in ("Transformer", "models.Transformer"):
            raise ModelLoadError(
                f"the sentence-transformers module {kind!r} is not supported (inlinelm runs "
                "Transformer, Pooling and Normalize)",
                path=str(folder / "modules.json"),
            )
    return (method or "cls"), normalize


def _pooling_method(path: Path) -> PoolingMethod:
    raw = _json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError("cannot read the Pooling module's config", path=str(path))
    chosen = [method for key, method in _POOLING_MODES.items() if raw.get(key)]
    others = [
        key
        for key, value in raw.items()
        if key.startswith("pooling_mode_") and value and key not in _POOLING_MODES
    ]
    if others or len(chosen) != 1:
        raise ModelLoadError(
            f"pooling {', '.join([*others, *(k for k in _POOLING_MODES if raw.get(k))])} is not "
            "supported: inlinelm pools by exactly one of CLS, mean or last token",
            path=str(path),
        )
    return chosen[0]


def _prompts(folder: Path) -> dict[str, str]:
    """The named prompts, with the default's name under ``"\\0default"``."""
    raw = _json(folder / "config_sentence_transformers.json")
    if not isinstance(raw, dict):
        return {}
    prompts = raw.get("prompts") or {}
    out = {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}
    default = raw.get("default_prompt_name")
    if isinstance(default, str) and default in out:
        out["\0default"] = default
    return out


def _max_seq_length(folder: Path) -> int | None:
    raw = _json(folder / "sentence_bert_config.json")
    value = raw.get("max_seq_length") if isinstance(raw, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path.name} ({e})", path=str(path)) from e
