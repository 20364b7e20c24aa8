"""Gemma 2: Llama with (1 + weight) norms around both blocks (four per layer), embeddings
scaled by sqrt(hidden), a query scale of its own, tanh-GELU, soft-capped attention and
logits, and sliding-window layers alternating with global ones."""

from __future__ import annotations

from dataclasses import replace

import torch

from inlinelm.gpu.attention.metadata import AttentionBackend, AttentionMetadata, LayerAttention
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields, show
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.layers.attention import Ropes
from inlinelm.gpu.model.models.decoder import DecoderLayer, DecoderModel, norm
from inlinelm.gpu.model.models.family import Family


class SandwichLayer(DecoderLayer):
    """Each block normed before and after: ``h + post(block(pre(h)))``."""

    def __init__(
        self, cfg: ModelConfig, index: int, backend: AttentionBackend, kernels: Kernels
    ) -> None:
        super().__init__(cfg, index, backend, kernels)
        self.pre_feedforward_layernorm = norm(cfg, kernels)
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
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, ropes, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(DecoderModel):
    """Embeddings times sqrt(hidden) rounded to the model's dtype (as Gemma's reference
    rounds it), the final logits soft-capped when the config says."""

    layer_class = SandwichLayer

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """See :meth:`DecoderModel.scale_embeddings`."""
        scale = torch.tensor(self.config.embedding_scale, dtype=x.dtype).item()
        return x * scale

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """See :meth:`DecoderModel.finish_logits`."""
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gemma_base(fields: ConfigFields, cfg: ModelConfig, default_pattern: int) -> ModelConfig:
    """What Gemma 2 and 3 share: the norms, the activation, the embedding scale, the query
    scale, the soft caps and the sliding layers (without ``layer_types``: all but every
    ``sliding_window_pattern``-th layer, ``default_pattern`` when that is absent too)."""
    scale = fields.positive_number("query_pre_attn_scalar", cfg.head_dim) ** -0.5
    if "layer_types" in fields.raw:
        window = cfg.sliding_window or 0
        sliding = [spec.attention.sliding_window is not None for spec in cfg.layers]
    else:
        window = fields.positive_int("sliding_window", 4096)
        pattern = fields.positive_int("sliding_window_pattern", default_pattern)
        sliding = [bool((i + 1) % pattern) for i in range(cfg.num_layers)]
    softcap = fields.optional_positive_number("attn_logit_softcapping")
    layers = tuple(
        replace(spec, attention=LayerAttention(scale, window if windowed else None, softcap))
        for spec, windowed in zip(cfg.layers, sliding, strict=True)
    )
    activation = fields.raw.get("hidden_activation", fields.raw.get("hidden_act"))
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh", None):
        raise fields.error("hidden_activation", f"unsupported activation {show(activation)}")
    return replace(
        cfg,
        layers=layers,
        sliding_window=window if any(sliding) else None,
        norm_offset=1.0,
        activation="gelu_tanh",
        embedding_scale=cfg.hidden_size**0.5,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", True),
        final_softcap=fields.optional_positive_number("final_logit_softcapping"),
    )


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """Gemma 2's: :func:`gemma_base`, every other layer sliding by default."""
    return gemma_base(fields, cfg, default_pattern=2)


GEMMA2 = Family(
    name="Gemma 2",
    model_types=("gemma2",),
    architectures=("Gemma2ForCausalLM",),
    examples=("google/gemma-2-2b-it", "google/gemma-2-9b-it"),
    gguf="gemma2",
    model=GemmaModel,
    configure=configure,
)
