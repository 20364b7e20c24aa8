"""The dense gated MLP: ``down(act(gate(x)) * up(x))``, gate and up fused in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.model.config import Activation
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.layers.linear import Linear


class GatedMLP(nn.Module):
    """SwiGLU (``silu``) or GeGLU (``gelu_tanh``, Gemma) feed-forward."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation,
        kernels: Kernels,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gelu = activation == "gelu_tanh"
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        k = self.kernels
        hidden = k.gelu_tanh_and_mul(gate_up) if self.gelu else k.silu_and_mul(gate_up)
        result: torch.Tensor = self.down_proj(hidden)
        return result
