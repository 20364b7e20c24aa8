"""Which attention backend an engine runs: the ``attention_backend`` engine option.

``"auto"`` picks FlashInfer on a CUDA device when ``import flashinfer`` works, the torch
backend otherwise; ``"flashinfer"`` insists (and fails clearly where it cannot run);
``"torch"`` always takes the torch backend. FlashInfer's kernels take 16-bit floats and
head dims 64, 128 and 256 only (the FA2 head dims its prebuilt kernels are built for,
``flashinfer/aot.py``), so any other model runs the torch backend. Sliding windows, soft
caps and query scales of any layer both backends take.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch

from inlinelm.config import AttentionBackendName
from inlinelm.errors import ConfigError
from inlinelm.gpu.attention.metadata import AttentionBackend, LayerAttention
from inlinelm.gpu.attention.torch_backend import TorchAttention

AttentionBackendKind = Literal["flashinfer", "torch"]
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def select_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, *, head_dim: int
) -> AttentionBackendKind:
    """Resolve the engine option ``name`` for a ``dtype`` model on ``device``.

    Raises :class:`~inlinelm.errors.ConfigError` (``option="attention_backend"``) for an
    unknown name, or for ``"flashinfer"`` off CUDA, with a float32 model, a head dim its
    kernels lack, or without an importable ``flashinfer``.
    """
    if name not in get_args(AttentionBackendName):
        raise ConfigError(
            f"attention_backend must be one of {', '.join(get_args(AttentionBackendName))}, "
            f"not {name!r}",
            option="attention_backend",
        )
    if name == "torch":
        return "torch"
    why_not = _why_not_flashinfer(device, dtype, head_dim)
    if why_not is None:
        return "flashinfer"
    if name == "flashinfer":
        raise ConfigError(f"attention_backend 'flashinfer' {why_not}", option="attention_backend")
    return "torch"


def _why_not_flashinfer(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer cannot run this model here, or None when it can (the import is tried
    last, and only on CUDA)."""
    if device.type != "cuda":
        return f"needs a CUDA device, not {device.type!r}"
    if dtype not in FLASHINFER_DTYPES:
        return f"needs dtype bfloat16 or float16, not {dtype}"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"needs a head dim in {FLASHINFER_HEAD_DIMS}, not {head_dim}"
    error = _flashinfer_import_error()
    if error is not None:
        return (
            f"cannot import flashinfer ({error}); "
            "install the 'gpu' extra (flashinfer-python) or use 'torch'"
        )
    return None


def make_attention_backend(
    name: str,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layers: Sequence[LayerAttention],
    cpu_ops: Any = None,
) -> AttentionBackend:
    """Build the backend :func:`select_attention_backend` picks for ``name`` on ``device``,
    for layers of the kinds ``layers`` (``ModelConfig.attention_kinds``; FlashInfer plans
    each distinct kind once per step, the torch backend needs none ahead); ``cpu_ops``
    (:func:`~inlinelm.gpu.model.cpu_extension.cpu_ops`) gives the torch backend the CPU
    extension's KV write and decode attention."""
    if select_attention_backend(name, device, dtype, head_dim=head_dim) == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim, cpu_ops)
    from inlinelm.gpu.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(num_heads, num_kv_heads, head_dim, dtype, device, layers)


def _flashinfer_import_error() -> str | None:
    """Why ``import flashinfer`` fails here, or None when it works (only asked on CUDA)."""
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # a broken install must fall back, not crash
        return f"{type(exc).__name__}: {exc}"
    return None
