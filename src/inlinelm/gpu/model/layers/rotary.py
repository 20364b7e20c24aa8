"""The RoPE table a model's layers rotate with (see :mod:`inlinelm.gpu.model.rope`)."""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.model.rope import RopeConfig, cos_sin_cache


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position up to ``max_positions`` for the first
    ``rotary_dim`` dimensions of each head, in float32, laid out as
    :class:`~inlinelm.gpu.model.kernels.RopeInputs` says."""

    def __init__(self, rope: RopeConfig, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", cos_sin_cache(rope, rotary_dim, max_positions), persistent=False
        )
