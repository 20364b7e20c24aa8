"""Shared helpers for the model tests: our model loader, the transformers reference, and a
minimal paged driver that batches chunked prefill and decode without the scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.loading.weights import load_model
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.registry import read_model_config
from inlinelm.gpu.model.rope import long_context_from

BLOCK_SIZE = 16
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea and the wind, and explain why it works.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Les fleurs du jardin sont très belles au printemps, et les oiseaux chantent 🐦 早上好",
]


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (its shards, when it has an index)."""
    from safetensors.torch import load_file

    from inlinelm.gpu.loading.model_files import weight_files

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        tensors.update(load_file(str(path)))
    return tensors


def load_ours(folder: Path, quantization: str = "none") -> DecoderModel:
    cfg = read_model_config(folder)
    backend = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return load_model(
        folder,
        cfg,
        dtype=torch.float32,
        device=torch.device("cpu"),
        backend=backend,
        max_positions=2048,
        quantization=quantization,
    )


def logits_atol(config: ModelConfig, expected: torch.Tensor) -> float:
    """How far our float32 logits may stray from transformers' on another CPU or kernel.

    Each layer's matmuls sum ~``hidden_size`` products; another summation order (SIMD
    width, oneDNN blocking) moves each sum by ~sqrt(hidden_size) roundings of relative size
    eps (a random walk, not the n*eps worst case). The residual stream carries every layer's
    error on, so ``num_layers`` of them add up, and the logits scale the result by their own
    size: atol = eps * num_layers * sqrt(hidden_size) * max|logit|. SmolLM2-135M (30 layers,
    hidden 576, max|logit| ~30): ~2.6e-3, ~18x the worst difference seen (1.4e-4); a 1%
    change to one weight matrix moves the logits of a prompt of a few tokens by 5e-2..1e-1
    (test_llama pins that margin)."""
    eps = torch.finfo(torch.float32).eps
    return eps * config.num_layers * config.hidden_size**0.5 * expected.abs().max().item()


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor, config: ModelConfig) -> None:
    """Every logit within :func:`logits_atol` of the reference (no rtol: the rounding error
    of a logit scales with the hidden state, not with that logit)."""
    torch.testing.assert_close(got, expected, rtol=0.0, atol=logits_atol(config, expected))


def load_reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


class PagedGreedyDriver:
    """A minimal stand-in for the scheduler: chunked prefill and decode of many sequences in one batch."""

    def __init__(
        self, model: DecoderModel, num_blocks: int = 256, kv_dtype: torch.dtype | None = None
    ) -> None:
        cfg = model.config
        self.model = model
        dtype = kv_dtype or model.embed_tokens.weight.dtype
        self.caches = [
            torch.zeros(2, num_blocks * BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
            for _ in range(cfg.num_layers)
        ]
        self.next_block = num_blocks - 1  # hand out blocks from the top, out of order on purpose

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, chunk: int
    ) -> list[list[int]]:
        tokens = [list(p) for p in prompts]
        computed = [0] * len(prompts)
        tables: list[list[int]] = [[] for _ in prompts]
        generated: list[list[int]] = [[] for _ in prompts]
        while any(len(g) < max_new_tokens for g in generated):
            live = [i for i, g in enumerate(generated) if len(g) < max_new_tokens]
            counts = [min(chunk, len(tokens[i]) - computed[i]) for i in live]
            for i, n in zip(live, counts, strict=True):
                self._grow(tables[i], computed[i] + n)
            sampled = self._step(live, counts, tokens, computed, tables)
            for i, n in zip(live, counts, strict=True):
                computed[i] += n
                if i in sampled:
                    tokens[i].append(sampled[i])
                    generated[i].append(sampled[i])
        return generated

    def _grow(self, table: list[int], length: int) -> None:
        while len(table) * BLOCK_SIZE < length:
            table.append(self.next_block)
            self.next_block -= 1

    def _step(
        self,
        live: list[int],
        counts: list[int],
        tokens: list[list[int]],
        computed: list[int],
        tables: list[list[int]],
    ) -> dict[int, int]:
        ids, pos, slots, starts, seq_lens = [], [], [], [0], []
        for i, n in zip(live, counts, strict=True):
            for p in range(computed[i], computed[i] + n):
                ids.append(tokens[i][p])
                pos.append(p)
                slots.append(tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            starts.append(starts[-1] + n)
            seq_lens.append(computed[i] + n)
        width = max(len(tables[i]) for i in live)
        table = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in live])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            block_tables=table,
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
        )
        samples = [k for k, i in enumerate(live) if computed[i] + counts[k] == len(tokens[i])]
        self.model.layers[0].self_attn.backend.prepare(meta, BLOCK_SIZE)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids),
                torch.tensor(pos),
                self.caches,
                meta,
                torch.tensor([starts[k + 1] - 1 for k in samples]),
            )
        return {live[k]: int(t) for k, t in zip(samples, logits.argmax(-1).tolist(), strict=True)}


def prefill_logits(
    model: DecoderModel, ids: list[int], kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Logits of every position of one sequence prefilled at once, through a paged cache of
    ``kv_dtype`` (default: the model's dtype)."""
    driver = PagedGreedyDriver(model, kv_dtype=kv_dtype)
    n = len(ids)
    table = list(range(-(-n // BLOCK_SIZE)))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.tensor([table]),
        max_query_len=n,
        max_seq_len=n,
    )
    model.layers[0].self_attn.backend.prepare(meta, BLOCK_SIZE)
    with torch.inference_mode():
        return model(torch.tensor(ids), rope_rows(model, n), driver.caches, meta, torch.arange(n))


def rope_rows(model: DecoderModel, n: int) -> torch.Tensor:
    """The RoPE rows of one sequence of ``n`` tokens: its positions, but for a longrope
    sequence past the original length, the long rows after the table's ``max_positions``
    (:mod:`inlinelm.gpu.model.rope`; the engine's InputBatch picks them so)."""
    positions = torch.arange(n)
    limit = long_context_from(model.config.rope)
    if limit is None or n <= limit:
        return positions
    return torch.where(positions < limit, positions + model.max_positions, positions)


def reference_greedy(ref: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]
