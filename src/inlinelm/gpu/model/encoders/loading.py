"""Build an encoder model and fill it from a Hugging Face folder's safetensors files.

A checkpoint names its tensors as transformers saved them: with the base model's prefix
(``bert.``, ``roberta.``, ``model.``) when a head was saved around it
(``*ForSequenceClassification``, ``*ForMaskedLM``), without it for the bare model (as
sentence-transformers saves one at its folder's root). Old BERT checkpoints name their
LayerNorms' parameters ``gamma`` and ``beta``. Tensors no parameter takes (an MLM head,
a pooler the model does not use, position-id buffers) are skipped.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.model_files import weight_files
from inlinelm.gpu.model.encoders.bert import BertEncoder
from inlinelm.gpu.model.encoders.config import EncoderConfig
from inlinelm.gpu.model.encoders.linear import EncoderLinear
from inlinelm.gpu.model.encoders.model import EncoderModel, WeightTarget
from inlinelm.gpu.model.encoders.modernbert import ModernBertEncoder
from inlinelm.gpu.model.layers.linear import onednn_packing_available

logger = logging.getLogger(__name__)

BASE_PREFIXES = ("bert.", "roberta.", "model.")
"""The names transformers' heads give their base model, stripped from checkpoint names."""

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors header names
_OLD_NAMES = {"gamma": "weight", "beta": "bias"}


def build_encoder(cfg: EncoderConfig) -> EncoderModel:
    """The model of ``cfg``'s family, its parameters left as the current device makes them
    (build under ``torch.device("meta")`` to allocate nothing)."""
    if cfg.model_type == "modernbert":
        return ModernBertEncoder(cfg)
    return BertEncoder(cfg)


def load_encoder(
    folder: Path, cfg: EncoderConfig, dtype: torch.dtype, device: torch.device
) -> EncoderModel:
    """Build the model of ``cfg`` in ``dtype`` on ``device`` and fill every parameter from
    ``folder``'s ``*.safetensors`` files (``model.safetensors``, or the shards its index
    names). The model is returned in eval mode, no parameter asking for gradients; on a
    CPU its linear layers keep their weights only in oneDNN's layout (do not move it to
    another device or dtype: load it again).

    Raises ``ModelLoadError`` naming the file and the tensor for a missing tensor, a
    tensor of the wrong shape or of a non-float dtype (both checked from the header, before
    the data is read), and an unreadable or truncated file.
    """
    from safetensors import SafetensorError

    start = time.perf_counter()
    with torch.device("meta"):
        model = build_encoder(cfg)
    model = model.to(dtype=dtype).to_empty(device=device).requires_grad_(False)
    targets = model.checkpoint_targets()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in weight_files(folder):
        try:
            _load_file(path, targets, params, loaded)
        # NOTE: the boundary of the file read: safetensors reports a bad header or data as
        # SafetensorError, the OS an unreadable file as OSError.
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(
                f"unreadable or truncated safetensors file ({e})", path=str(path)
            ) from e
    _check_complete(folder, targets, loaded)
    if onednn_packing_available(device, dtype):
        _pack_for_onednn(model)
    logger.info("loaded %s weights in %.2f s", folder.name, time.perf_counter() - start)
    return model.eval()


def _pack_for_onednn(model: EncoderModel) -> None:
    """Lay every linear layer's weight out for oneDNN (:mod:`.linear` says why)."""
    linears = [m for m in model.modules() if isinstance(m, EncoderLinear)]
    packed = sum(m.pack() for m in linears)
    logger.info("packed %d of %d linear layers for oneDNN", packed, len(linears))


def checkpoint_key(name: str, targets: dict[str, WeightTarget]) -> str | None:
    """The key of ``targets`` a checkpoint tensor's name stands for (None: not ours)."""
    stem, _, last = name.rpartition(".")
    if last in _OLD_NAMES and stem.endswith("LayerNorm"):
        name = f"{stem}.{_OLD_NAMES[last]}"
    if name in targets:
        return name
    for prefix in BASE_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :] in targets:
            return name[len(prefix) :]
    return None


def _load_file(
    path: Path,
    targets: dict[str, WeightTarget],
    params: dict[str, torch.nn.Parameter],
    loaded: set[str],
) -> None:
    """Copy the tensors of one file that ``targets`` name into ``params``, adding their
    keys to ``loaded``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            key = checkpoint_key(name, targets)
            if key is None:
                continue
            dest = _destination(params, targets[key])
            header = f.get_slice(name)
            _check_header(header.get_dtype(), tuple(header.get_shape()), dest, path, name)
            dest.copy_(f.get_tensor(name))
            loaded.add(key)


def _destination(params: dict[str, torch.nn.Parameter], target: WeightTarget) -> torch.Tensor:
    """The parameter (or its rows, for a piece of a fused one) a target fills."""
    param = params[target.param]
    if target.rows is None:
        return param
    return param[target.rows[0] : target.rows[1]]


def _check_header(
    dtype: str, shape: tuple[int, ...], dest: torch.Tensor, path: Path, name: str
) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise ModelLoadError(
            f"unsupported weight dtype {dtype} for tensor {name} "
            f"(supported: {', '.join(_FLOAT_DTYPES)})",
            path=str(path),
            field=name,
        )
    if shape != tuple(dest.shape):
        raise ModelLoadError(
            f"shape mismatch for tensor {name}: file has {shape}, "
            f"model expects {tuple(dest.shape)}",
            path=str(path),
            field=name,
        )


def _check_complete(folder: Path, targets: dict[str, WeightTarget], loaded: set[str]) -> None:
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ModelLoadError(
            f"{len(missing)} weight tensors missing, first: {missing[0]}",
            path=str(folder),
            field=missing[0],
        )
