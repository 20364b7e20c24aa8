"""The token embedding, as float rows or as block-quantized ones."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from inlinelm.gpu.model.layers.blocks import BlockWeight


class Embedding(nn.Module):
    """``weight[ids]`` (``nn.Embedding``'s parameter name and layout, [vocab, hidden]).

    With block-quantized weights (:meth:`use_blocks`) a lookup dequantizes the rows it
    reads, in the model's dtype, and a tied LM head computes with the same tiles, so a tied
    model keeps one copy of the matrix.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self._blocks: BlockWeight | None = None

    @property
    def blocks(self) -> BlockWeight | None:
        """The block-quantized rows, or None for float rows."""
        return self._blocks

    def use_blocks(self, weight: BlockWeight) -> None:
        """Look rows up in block-quantized ``weight`` [vocab, hidden]; the float weight is
        dropped (its dtype stays the model's, the lookups' dtype)."""
        assert weight.shape == tuple(self.weight.shape)
        self._blocks = weight
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._blocks is None:
            return F.embedding(ids, self.weight)
        return self._blocks.lookup(ids).to(self.weight.dtype)
