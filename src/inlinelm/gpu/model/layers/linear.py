"""The decoder's linear layers: ``y = x @ W.T + b`` over weights laid out for fast reads."""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.model.layers.blocks import BlockWeight


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored transposed, as ``weight_t`` [in, out].

    A decode step is a batch of GEMVs; on a CPU, MKL reads a row-major [in, out] matrix
    at ~1.7x the bandwidth of the usual [out, in] layout (measured on this project's
    2-core machines: ~26 vs ~15 GB/s), and decode is bound by reading the weights.

    :meth:`pack_for_onednn` goes further on a CPU: it re-lays the weight out in oneDNN's
    blocked format and drops the plain copy. oneDNN's GEMM splits even a one-row GEMV
    over every intra-op thread and picks AVX-512 kernels on any x86 vendor; MKL's does
    neither here (measured on this model's shapes, 2 threads: the 538 MB of weights in
    16 ms instead of 24 ms at one row, 36 ms instead of 77 ms at 32 rows).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None
        self._blocks: BlockWeight | None = None

    @property
    def blocks(self) -> BlockWeight | None:
        """The block-quantized weights, or None for float weights."""
        return self._blocks

    def use_blocks(self, weight: BlockWeight) -> None:
        """Compute with block-quantized ``weight`` [out, in] (a loader fills it, row ranges
        at a time, or shares another module's: the tied LM head reads the embedding's);
        the float weight is dropped. Only where ``cpu_extension()`` built."""
        in_features, out_features = self.weight_t.shape
        assert weight.shape == (out_features, in_features)
        self._blocks = weight
        self._packed = None
        self.weight_t.data = torch.empty(0, dtype=self.weight_t.dtype, device=self.weight_t.device)
        if self.bias is not None:
            self.bias.data = self.bias.data.float()

    def pack_for_onednn(self) -> bool:
        """Keep the weight only in oneDNN's CPU layout (after loading; not reversible).

        The packed layer is checked against the plain matmul on a small input first; on any
        error or mismatch (these are torch-internal ops) the layer stays as it was and
        False is returned.
        """
        weight = self.weight_t.data.t().contiguous()
        probe = torch.randn(2, weight.shape[1], dtype=weight.dtype)
        with torch.no_grad():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            except (RuntimeError, TypeError, AttributeError):
                return False
            # NOTE: the two may sum in other orders: a few roundings of the dtype apart
            tol = 1e-4 if weight.dtype == torch.float32 else 4 * torch.finfo(weight.dtype).eps
            if not torch.allclose(got, self(probe), rtol=tol, atol=tol):
                return False
        self._packed = packed
        self.weight_t.data = torch.empty(0, dtype=weight.dtype)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._blocks is not None:
            return self._blocks.matmul(x, self.bias)
        if self._packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "none", [], ""
            )
            return out
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :meth:`Linear.pack_for_onednn` applies: float32 on a CPU torch built with
    oneDNN, and bfloat16 where the CPU has bfloat16 instructions (AVX-512 BF16 or AMX;
    elsewhere oneDNN emulates them, and float16 too, so those keep plain matmuls)."""
    if dtype == torch.bfloat16:
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if supported is None or not supported():
            return False
    elif dtype != torch.float32:
        return False
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


ONEDNN_BATCH_HINT = 16
"""Rows oneDNN lays the weights out for; one layout serves every row count (measured:
within 15% of the best hint from 1 to 512 rows)."""
