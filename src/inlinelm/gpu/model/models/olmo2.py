"""OLMo 2: norms after attention and the MLP (not before), and q/k norms over the whole
projection rather than per head."""

from __future__ import annotations

from dataclasses import replace

import torch

from inlinelm.gpu.attention.metadata import AttentionBackend, AttentionMetadata
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.layers.attention import Ropes
from inlinelm.gpu.model.models.decoder import DecoderLayer, DecoderModel, norm
from inlinelm.gpu.model.models.family import Family


class PostNormLayer(DecoderLayer):
    """``h + post(block(h))`` for each block: nothing normalises a block's input."""

    def __init__(
        self, cfg: ModelConfig, index: int, backend: AttentionBackend, kernels: Kernels
    ) -> None:
        super().__init__(cfg, index, backend, kernels)
        del self.input_layernorm
        self.post_feedforward_layernorm = norm(cfg, kernels)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: Ropes,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`DecoderLayer.forward`."""
        hidden = x if residual is None else x + residual
        hidden = hidden + self.post_attention_layernorm(
            self.self_attn(hidden, ropes, kv_cache, meta)
        )
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2Model(DecoderModel):
    """The decoder of :class:`PostNormLayer` layers."""

    layer_class = PostNormLayer


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """Whole-projection q/k norms."""
    return replace(cfg, qk_norm="whole")


OLMO2 = Family(
    name="OLMo 2",
    model_types=("olmo2",),
    architectures=("Olmo2ForCausalLM",),
    examples=("allenai/OLMo-2-0425-1B-Instruct", "allenai/OLMo-2-1124-7B-Instruct"),
    gguf="olmo2",
    model=Olmo2Model,
    configure=configure,
)
