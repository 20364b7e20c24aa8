"""ModernBERT: RoPE, global layers alternating with sliding-window ones, GeGLU, pre-norm.

Global layers rotate with ``global_rope_theta`` and see the whole sequence; local ones
rotate with ``local_rope_theta`` and see the tokens at most ``local_attention // 2`` away.
Biases only where the config asks (``attention_bias``, ``mlp_bias``, ``norm_bias``). The
classifier pools the first token or the mean, then dense + activation + norm and a
linear layer (``head`` and ``classifier``).
"""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.model.encoders.attention import Rotary, rotary_tables, self_attention
from inlinelm.gpu.model.encoders.config import EncoderConfig
from inlinelm.gpu.model.encoders.linear import EncoderLinear, activate
from inlinelm.gpu.model.encoders.model import (
    EncoderModel,
    WeightTarget,
    first_rows,
    mean_rows,
    module_targets,
)
from inlinelm.gpu.model.encoders.ragged import RaggedBatch


def _norm(cfg: EncoderConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


class ModernBertLayer(nn.Module):
    """Normed self-attention then a normed GeGLU MLP, each added to its input (the first
    layer's attention takes its input unnormed: the embeddings are normed already)."""

    def __init__(self, cfg: EncoderConfig, index: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.cfg = cfg
        self.window = cfg.layer_windows[index]
        self.attn_norm: nn.Module = _norm(cfg) if index > 0 else nn.Identity()
        self.qkv = EncoderLinear(hidden, 3 * hidden, bias=cfg.attention_bias)
        self.attn_out = EncoderLinear(hidden, hidden, bias=cfg.attention_bias)
        self.mlp_norm = _norm(cfg)
        self.wi = EncoderLinear(hidden, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.wo = EncoderLinear(cfg.intermediate_size, hidden, bias=cfg.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        batch: RaggedBatch,
        masks: tuple[torch.Tensor | None, ...],
        rotary: Rotary,
    ) -> torch.Tensor:
        qkv = self.qkv(self.attn_norm(x))
        attended = self_attention(qkv, batch, self.cfg.num_heads, masks, rotary)
        x = self.attn_out(attended, residual=x)
        value, gate = self.wi(self.mlp_norm(x)).chunk(2, dim=-1)
        out: torch.Tensor = self.wo(activate(value, self.cfg.activation) * gate, residual=x)
        return out

    def checkpoint_targets(self, source: str, dest: str) -> dict[str, WeightTarget]:
        """Layer ``source`` (``layers.N``) of a checkpoint into ``dest``."""
        return {
            **module_targets(f"{source}.attn_norm", f"{dest}.attn_norm", self.attn_norm),
            **module_targets(f"{source}.attn.Wqkv", f"{dest}.qkv", self.qkv),
            **module_targets(f"{source}.attn.Wo", f"{dest}.attn_out", self.attn_out),
            **module_targets(f"{source}.mlp_norm", f"{dest}.mlp_norm", self.mlp_norm),
            **module_targets(f"{source}.mlp.Wi", f"{dest}.wi", self.wi),
            **module_targets(f"{source}.mlp.Wo", f"{dest}.wo", self.wo),
        }


class ModernBertHead(nn.Module):
    """Dense + activation + norm on the pooled state, then the label projection."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dense = EncoderLinear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.norm = _norm(cfg)
        self.out = EncoderLinear(cfg.hidden_size, cfg.num_labels, bias=True)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(
            self.norm(activate(self.dense(pooled), self.cfg.classifier_activation))
        )
        return logits


class ModernBertEncoder(EncoderModel):
    """ModernBERT (``model_type`` ``modernbert``)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_norm = _norm(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg)
        self.head = ModernBertHead(cfg) if cfg.classifier else None

    def encode(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, batch: RaggedBatch
    ) -> torch.Tensor:
        # 1) the tables and masks each kind of layer shares, once per batch
        cfg, device = self.config, input_ids.device
        global_rotary = rotary_tables(cfg.global_rope_theta, cfg.head_dim, batch.max_len, device)
        local_rotary = rotary_tables(cfg.local_rope_theta, cfg.head_dim, batch.max_len, device)
        masks = {w: batch.attention_masks(w) for w in set(cfg.layer_windows)}
        # 2) the layers, in the batch's sorted layout
        x = self.embed_norm(self.tok_embeddings(batch.sort(input_ids)))
        for layer in self.layers:
            assert isinstance(layer, ModernBertLayer)
            rotary = global_rotary if layer.window is None else local_rotary
            x = layer(x, batch, masks[layer.window], rotary)
        out: torch.Tensor = self.final_norm(x)
        return batch.unsort(out)

    def score(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        assert self.head is not None
        if self.config.classifier_pooling == "cls":
            pooled = first_rows(hidden, seq_lens)
        else:
            pooled = mean_rows(hidden, seq_lens)
        logits: torch.Tensor = self.head(pooled)
        return logits

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        targets = {
            **module_targets("embeddings.tok_embeddings", "tok_embeddings", self.tok_embeddings),
            **module_targets("embeddings.norm", "embed_norm", self.embed_norm),
            **module_targets("final_norm", "final_norm", self.final_norm),
        }
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, ModernBertLayer)
            targets.update(layer.checkpoint_targets(f"layers.{i}", f"layers.{i}"))
        if self.head is not None:
            targets.update(module_targets("head.dense", "head.dense", self.head.dense))
            targets.update(module_targets("head.norm", "head.norm", self.head.norm))
            targets.update(module_targets("classifier", "head.out", self.head.out))
        return targets
