"""BERT and XLM-RoBERTa: learned absolute positions and token types, post-norm layers.

The two differ only in where positions start (XLM-RoBERTa's first token is at
``pad_token_id + 1``, :attr:`~.config.EncoderConfig.position_offset`), in their base
model's name in checkpoints, and in their classifier's tensor names: both classify with a
dense + tanh layer on the first token, then a linear layer (BERT's ``pooler`` and
``classifier``, XLM-RoBERTa's ``classifier.dense`` and ``classifier.out_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from inlinelm.gpu.model.encoders.attention import self_attention
from inlinelm.gpu.model.encoders.config import EncoderConfig
from inlinelm.gpu.model.encoders.linear import EncoderLinear
from inlinelm.gpu.model.encoders.model import (
    EncoderModel,
    WeightTarget,
    first_rows,
    fused_targets,
    module_targets,
)
from inlinelm.gpu.model.encoders.ragged import RaggedBatch


class BertLayer(nn.Module):
    """Self-attention then an MLP, each added to its input and layer-normed after."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.cfg = cfg
        self.qkv = EncoderLinear(hidden, 3 * hidden, bias=True)
        self.attn_out = EncoderLinear(hidden, hidden, bias=True)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = EncoderLinear(hidden, cfg.intermediate_size, bias=True)
        self.down = EncoderLinear(cfg.intermediate_size, hidden, bias=True)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(
        self, x: torch.Tensor, batch: RaggedBatch, masks: tuple[torch.Tensor | None, ...]
    ) -> torch.Tensor:
        attended = self_attention(self.qkv(x), batch, self.cfg.num_heads, masks)
        x = self.attn_norm(self.attn_out(attended, residual=x))
        hidden = self.up.activated(x, self.cfg.activation)
        out: torch.Tensor = self.mlp_norm(self.down(hidden, residual=x))
        return out

    def checkpoint_targets(self, source: str, dest: str) -> dict[str, WeightTarget]:
        """Layer ``source`` (``encoder.layer.N``) of a checkpoint into ``dest``."""
        attention = f"{source}.attention"
        return {
            **fused_targets(
                tuple(f"{attention}.self.{p}" for p in ("query", "key", "value")),
                f"{dest}.qkv",
                self.qkv,
            ),
            **module_targets(f"{attention}.output.dense", f"{dest}.attn_out", self.attn_out),
            **module_targets(f"{attention}.output.LayerNorm", f"{dest}.attn_norm", self.attn_norm),
            **module_targets(f"{source}.intermediate.dense", f"{dest}.up", self.up),
            **module_targets(f"{source}.output.dense", f"{dest}.down", self.down),
            **module_targets(f"{source}.output.LayerNorm", f"{dest}.mlp_norm", self.mlp_norm),
        }


class PoolerHead(nn.Module):
    """Dense + tanh on a sequence's first token, then the label projection."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = EncoderLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.out = EncoderLinear(cfg.hidden_size, cfg.num_labels, bias=True)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(torch.tanh(self.dense(first_tokens)))
        return logits


class BertEncoder(EncoderModel):
    """BERT (``model_type`` ``bert``) or XLM-RoBERTa (``xlm-roberta``)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg)
        hidden = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.head = PoolerHead(cfg) if cfg.classifier else None

    def encode(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, batch: RaggedBatch
    ) -> torch.Tensor:
        types = None if token_type_ids is None else batch.sort(token_type_ids)
        x = self.embed(batch.sort(input_ids), types, batch)
        masks = batch.attention_masks(None)
        for layer in self.layers:
            x = layer(x, batch, masks)
        return batch.unsort(x)

    def embed(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, batch: RaggedBatch
    ) -> torch.Tensor:
        """Word + token type + position embeddings, layer-normed (transformers' order), of
        tokens in the batch's sorted layout."""
        x = self.word_embeddings(input_ids)
        # NOTE: one token type (XLM-RoBERTa's) takes none from the input: a pair's
        # second-segment ids would index past the table.
        if token_type_ids is None or self.config.type_vocab_size == 1:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(batch.positions + self.config.position_offset)
        out: torch.Tensor = self.embed_norm(x)
        return out

    def score(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        assert self.head is not None
        logits: torch.Tensor = self.head(first_rows(hidden, seq_lens))
        return logits

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        targets = {
            **module_targets("embeddings.word_embeddings", "word_embeddings", self.word_embeddings),
            **module_targets(
                "embeddings.position_embeddings", "position_embeddings", self.position_embeddings
            ),
            **module_targets(
                "embeddings.token_type_embeddings",
                "token_type_embeddings",
                self.token_type_embeddings,
            ),
            **module_targets("embeddings.LayerNorm", "embed_norm", self.embed_norm),
        }
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, BertLayer)
            targets.update(layer.checkpoint_targets(f"encoder.layer.{i}", f"layers.{i}"))
        if self.head is not None:
            targets.update(self._head_targets(self.head))
        return targets

    def _head_targets(self, head: PoolerHead) -> dict[str, WeightTarget]:
        if self.config.model_type == "bert":
            dense, out = "pooler.dense", "classifier"
        else:
            dense, out = "classifier.dense", "classifier.out_proj"
        return {
            **module_targets(dense, "head.dense", head.dense),
            **module_targets(out, "head.out", head.out),
        }
