"""The token embedding, as float rows or as int8 rows with one float32 scale each."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Embedding(nn.Module):
    """``weight[ids]`` (``nn.Embedding``'s parameter name and layout, [vocab, hidden]).

    With int8 weights (:meth:`use_int8`) a lookup reads each row's int8 values times its
    scale, in the model's dtype: a quarter of float32's bytes, and the tied LM head computes
    with the same two tensors (an int8 LM head has one scale per output channel, which is
    one per embedding row), so a tied model keeps one copy of the matrix.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def int8(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 rows and their scales, or None for float rows."""
        return self._int8

    def use_int8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Look rows up in ``q`` [vocab, hidden] (int8) times ``scale`` ([vocab], or
        [vocab, groups] for a scale per group of a row's values); the float
        weight is dropped (its dtype stays the model's, the lookups' dtype)."""
        assert tuple(q.shape) == tuple(self.weight.shape) and q.dtype == torch.int8
        self._int8 = (q, scale)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._int8 is None:
            return F.embedding(ids, self.weight)
        q, scale = self._int8
        picked = q[ids].to(torch.float32)
        groups = scale[ids].reshape(*ids.shape, -1, 1)  # a scale per row, or per group
        rows = (picked.reshape(*ids.shape, groups.shape[-2], -1) * groups).reshape(picked.shape)
        return rows.to(self.weight.dtype)
