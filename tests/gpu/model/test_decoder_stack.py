"""A decode step's layers in one extension call (``DecoderStack``): for every family whose
layers it runs, batched decode steps over the paged cache (rows of different lengths,
windows, q/k norms, biases, residual scales, layers without RoPE) give the logits of the
Python layers to the bit, and the stack ran them; prefill steps and the families it does
not run keep the Python layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.loading.weights import load_model
from inlinelm.gpu.model import decoder_stack
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.decoder_stack import DecoderStack
from inlinelm.gpu.model.kernels import CpuKernels
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.registry import read_model_config
from tests.gpu.families import make_family_model
from tests.gpu.reference import BLOCK_SIZE

pytestmark = pytest.mark.skipif(cpu_extension() is None, reason="the CPU extension did not build")

STACKED = ["llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3"]
NOT_STACKED = ["gemma2", "gemma3_text", "olmo2", "qwen3_moe", "mixtral"]
PROMPTS = [[5, 9, 13], [7, 3, 1, 44, 81, 20, 6], [11] * 12, [300, 2, 17, 99, 58]]
"""Lengths 3 to 12, five decode steps after: all below phi3's original length (20)."""
DECODE = [[21, 22, 23, 24, 25], [1, 2, 3, 4, 5], [60, 61, 62, 63, 64], [7, 7, 7, 7, 7]]


def load(folder: Path, quantization: str = "int8", fused: bool = True) -> DecoderModel:
    """The model as a CPU runner loads it: the extension's kernels and attention (torch's
    without ``fused``)."""
    ops = cpu_extension() if fused else None
    cfg = read_model_config(folder)
    return load_model(
        folder,
        cfg,
        dtype=torch.float32,
        device=torch.device("cpu"),
        backend=TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cpu_ops=ops),
        max_positions=256,
        kernels=CpuKernels(ops) if ops is not None else None,
        quantization=quantization,
    )


def run_steps(model: DecoderModel) -> list[torch.Tensor]:
    """Every prompt prefilled in one step (their pages out of order), then five decode
    steps of all four rows: each step's logits."""
    cfg = model.config
    caches = [
        torch.zeros(2, 64 * BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers)
    ]
    tables = [[60 - 2 * i, 61 - 2 * i] for i in range(len(PROMPTS))]
    lengths = [0] * len(PROMPTS)
    backend = model.layers[0].self_attn.backend
    out = []
    feeds = [PROMPTS] + [[[d[k]] for d in DECODE] for k in range(len(DECODE[0]))]
    for feed in feeds:
        ids, positions, slots, starts = [], [], [], [0]
        for i, tokens in enumerate(feed):
            for t in tokens:
                p = lengths[i]
                ids.append(t)
                positions.append(p)
                slots.append(tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                lengths[i] += 1
            starts.append(len(ids))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(lengths),
            block_tables=torch.tensor(tables),
            max_query_len=max(np.diff(starts)),
            max_seq_len=max(lengths),
            host_query_start_loc=np.array(starts),
            host_seq_lens=np.array(lengths),
            host_block_tables=np.array(tables),
        )
        backend.prepare(meta, BLOCK_SIZE)
        with torch.inference_mode():
            last = torch.tensor(starts[1:]) - 1
            out.append(model(torch.tensor(ids), torch.tensor(positions), caches, meta, last))
    return out


@pytest.mark.parametrize("family", STACKED)
def test_the_stack_decodes_as_the_layers_do_to_the_bit(
    family: str, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(make_family_model(tmp_path / family, tokenizer_dir, family))
    stack = model.decoder_stack
    assert isinstance(stack, DecoderStack)
    ran: list[bool] = []
    decode = DecoderStack.decode

    def counted(self: DecoderStack, *args: Any) -> Any:
        result = decode(self, *args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(DecoderStack, "decode", counted)
    stacked = run_steps(model)
    assert ran == [False] + [True] * len(DECODE[0]), "prefill by the layers, decode stacked"
    model.use_decoder_stack(None)
    layers = run_steps(model)
    for step, (got, want) in enumerate(zip(stacked, layers, strict=True)):
        assert torch.equal(got, want), f"{family}: step {step}"
    assert not torch.equal(layers[1], layers[2]), "the steps compute something"


@pytest.mark.parametrize("family", NOT_STACKED)
def test_the_families_it_does_not_run_keep_their_layers(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    model = load(make_family_model(tmp_path / family, tokenizer_dir, family))
    assert model.decoder_stack is None


def test_float_weights_and_torchs_kernels_keep_the_layers(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_family_model(tmp_path / "llama", tokenizer_dir, "llama")
    assert load(folder, "none").decoder_stack is None
    assert load(folder, fused=False).decoder_stack is None  # torch's kernels and attention
    monkeypatch.setattr(decoder_stack, "cpu_extension", lambda: None)
    assert DecoderStack.of(load(folder)) is None
