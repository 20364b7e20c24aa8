"""RMSNorm, alone and with the residual add fused before it."""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.model.kernels import Kernels


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, scaled by ``offset + weight``
    (``offset`` 1 for Gemma's norms, whose checkpoints store ``weight`` around zero);
    :meth:`add_and_norm` fuses the residual add before it."""

    def __init__(self, size: int, eps: float, kernels: Kernels, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps, self.offset)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; may overwrite both inputs."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps, self.offset)
