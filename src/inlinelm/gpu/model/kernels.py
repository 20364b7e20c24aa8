"""The decoder's elementwise kernels: RMSNorm (alone and with the residual add fused; the
weight or Gemma's ``1 + weight``), RoPE (over the whole head or its first dimensions) and
the gated activations (SiLU, tanh-GELU); FlashInfer's on CUDA, inlinelm's own for a
float32 model on a CPU (``csrc/cpu_ops.cpp``, where its extension builds), plain torch
everywhere else.

The model takes one :class:`Kernels` when it is built (:func:`make_kernels`) and calls it
in every layer, so the choice is made once, never per call. ``flashinfer`` is imported
only when :class:`FlashInferKernels` is built, which only a CUDA runner does.

All implementations agree on the contracts below; the torch ones compute exactly what
the reference Llama implementation computes (float32 norms, a cast before the weight),
and the CPU ones the same in the same order of operations (their sums run in vector
lanes: the last bits differ), which keeps a CPU float32 model's greedy output equal to
transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

KernelsKind = Literal["flashinfer", "torch"]


@dataclass(slots=True)
class RopeInputs:
    """One forward's RoPE inputs, built once and shared by every layer.

    ``cos_sin_cache`` is [max_positions, head_dim] float32: the cosines of the
    ``head_dim / 2`` frequencies, then their sines (FlashInfer's layout). The torch
    kernels also gather ``cos``/``sin`` [T, 1, head_dim] in the model's dtype up front.
    """

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class Kernels(Protocol):
    """What a decoder layer calls besides its matmuls and attention."""

    kind: KernelsKind

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
    ) -> torch.Tensor:
        """``x / rms(x) * (offset + weight)`` over the last dim; ``x`` [T, hidden] is left
        unchanged. ``offset`` is 0 or 1 (Gemma's norms)."""
        ...

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``; may overwrite ``x`` and ``residual``."""
        ...

    def rope_inputs(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        """Everything :meth:`apply_rope` needs for one forward's ``positions``."""
        ...

    def apply_rope(self, qk: torch.Tensor, num_q_heads: int, rope: RopeInputs) -> torch.Tensor:
        """Rotate ``qk`` [T, Hq + Hkv, D] (queries, then keys; neox halves) over its first
        ``rope.cos_sin_cache.shape[-1]`` dimensions, the rest passed through; may work in
        place."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x`` = [gate | up] on the last dim."""
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` for ``x`` = [gate | up] on the last dim."""
        ...


class TorchKernels:
    """The kernels in plain torch ops: any device, any dtype."""

    kind: KernelsKind = "torch"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
    ) -> torch.Tensor:
        """See :class:`Kernels`. Gemma's norm (``offset``) multiplies in float32 before the
        cast, Llama's after it: each as its reference does."""
        if offset:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return (h * (offset + weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            # One fused kernel instead of seven ops (a CPU decode step is dispatch-bound).
            return F.rms_norm(x, weight.shape, weight, eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`Kernels`."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps, offset), residual

    def rope_inputs(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        """See :class:`Kernels`."""
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        return RopeInputs(
            positions,
            cos_sin_cache,
            torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1),
            torch.cat((sin, sin), dim=-1).to(dtype).unsqueeze(1),
        )

    def apply_rope(self, qk: torch.Tensor, num_q_heads: int, rope: RopeInputs) -> torch.Tensor:
        """See :class:`Kernels`."""
        # NOTE: queries and keys rotate together: one set of ops per layer, not two.
        assert rope.cos is not None and rope.sin is not None
        rotated = rope.cos.shape[-1]
        if rotated == qk.shape[-1]:
            return qk * rope.cos + _rotate_half(qk) * rope.sin
        part, rest = qk[..., :rotated], qk[..., rotated:]
        return torch.cat((part * rope.cos + _rotate_half(part) * rope.sin, rest), dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :class:`Kernels`."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :class:`Kernels`."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FlashInferKernels:
    """FlashInfer's fused CUDA kernels (16-bit activations only): one launch per call,
    where the torch versions take three to eight."""

    kind: KernelsKind = "flashinfer"

    def __init__(self) -> None:
        import flashinfer

        self._rmsnorm: Any = flashinfer.norm.rmsnorm
        self._fused_add_rmsnorm: Any = flashinfer.norm.fused_add_rmsnorm
        self._gemma_rmsnorm: Any = flashinfer.norm.gemma_rmsnorm
        self._gemma_fused_add_rmsnorm: Any = flashinfer.norm.gemma_fused_add_rmsnorm
        self._rope: Any = flashinfer.rope.apply_rope_with_cos_sin_cache_inplace
        self._silu_and_mul: Any = flashinfer.activation.silu_and_mul
        self._gelu_tanh_and_mul: Any = flashinfer.activation.gelu_tanh_and_mul

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
    ) -> torch.Tensor:
        """See :class:`Kernels` (``offset`` 1: FlashInfer's Gemma norm)."""
        # NOTE: the kernels take [N, D]; per-head norms arrive as [T, H, D].
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        norm = self._gemma_rmsnorm if offset else self._rmsnorm
        out: torch.Tensor = norm(x, weight, eps)
        return out.view(shape)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`Kernels` (in place: ``residual`` += ``x``, ``x`` = the norm)."""
        fused = self._gemma_fused_add_rmsnorm if offset else self._fused_add_rmsnorm
        fused(x, residual, weight, eps)
        return x, residual

    def rope_inputs(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        """See :class:`Kernels` (the kernel gathers the table by position itself)."""
        return RopeInputs(positions, cos_sin_cache)

    def apply_rope(self, qk: torch.Tensor, num_q_heads: int, rope: RopeInputs) -> torch.Tensor:
        """See :class:`Kernels` (in place; the head slices may be strided views; the table's
        width is the rotated dimensions, so partial rotary passes the rest through)."""
        self._rope(
            rope.positions,
            qk[:, :num_q_heads],
            qk[:, num_q_heads:],
            qk.shape[-1],
            rope.cos_sin_cache,
            is_neox=True,
        )
        return qk

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :class:`Kernels`."""
        out: torch.Tensor = self._silu_and_mul(x)
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :class:`Kernels`."""
        out: torch.Tensor = self._gelu_tanh_and_mul(x)
        return out


class CpuKernels(TorchKernels):
    """inlinelm's fused float32 CPU kernels (``csrc/cpu_ops.cpp``): one call each where the
    torch ones take three to eight ops, and RoPE in place, reading the table by position
    (no per-step gather). ``ops`` is the built extension
    (:func:`~inlinelm.gpu.model.cpu_extension.cpu_ops`); it checks every shape and stride
    it is given."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
    ) -> torch.Tensor:
        """See :class:`Kernels` (``x`` [T, D] or [T, H, D], rows at any stride)."""
        out: torch.Tensor = self._ops.rms_norm(x, weight, eps, offset)
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`Kernels` (in place: ``residual`` += ``x``, ``x`` = the norm)."""
        self._ops.add_rms_norm(x, residual, weight, eps, offset)
        return x, residual

    def rope_inputs(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        """See :class:`Kernels` (the kernel reads the table by position itself)."""
        return RopeInputs(positions.to(torch.int64).contiguous(), cos_sin_cache)

    def apply_rope(self, qk: torch.Tensor, num_q_heads: int, rope: RopeInputs) -> torch.Tensor:
        """See :class:`Kernels` (in place; ``qk`` may be a strided view)."""
        self._ops.rope(qk, rope.positions, rope.cos_sin_cache)
        return qk

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :class:`Kernels`."""
        out: torch.Tensor = self._ops.silu_and_mul(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], -1)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :class:`Kernels`."""
        out: torch.Tensor = self._ops.gelu_tanh_and_mul(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], -1)


def make_kernels(kind: KernelsKind, cpu_ops: Any = None) -> Kernels:
    """The kernels of ``kind``: the model follows the attention backend's choice (see
    :func:`~inlinelm.gpu.attention.select.select_attention_backend`), so ``"flashinfer"``
    only ever arrives for a 16-bit model on CUDA with ``flashinfer`` importable;
    ``cpu_ops`` (:func:`~inlinelm.gpu.model.cpu_extension.cpu_ops`, for a float32 model on
    a CPU) makes ``"torch"`` the fused CPU kernels."""
    if kind == "flashinfer":
        return FlashInferKernels()
    if cpu_ops is not None:
        return CpuKernels(cpu_ops)
    return TorchKernels()
