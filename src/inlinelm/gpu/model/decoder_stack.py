"""A decode step's decoder layers in one call of the CPU extension
(``csrc/decoder_stack.cpp``), for a model whose layers it can run.

At batch 1 a CPU decode step of the default model spent more time in its layers' Python
(module calls, tensor views, one extension call per op) than in their norms, RoPE, KV
writes and attention together. The stack runs the same extension operators on the same
tensors in the same order, so its result is the Python layers' to the bit; it only drops
the Python between them, and runs without the GIL.

It runs a step whose every row is a decode row (prefill chunks keep the Python layers:
their matmuls dwarf the calls). A model qualifies when every layer is the base pre-norm
:class:`~inlinelm.gpu.model.models.decoder.DecoderLayer` with per-head q/k norms or none, a
gated MLP, block-quantized linear layers, the CPU extension's kernels and its attention.
"""

from __future__ import annotations

from typing import Any

import torch

from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.kernels import CpuKernels
from inlinelm.gpu.model.layers.attention import Attention
from inlinelm.gpu.model.layers.blocks import KIND_IDS
from inlinelm.gpu.model.layers.mlp import GatedMLP
from inlinelm.gpu.model.models.decoder import DecoderLayer, DecoderModel

_TABLES = {"global": 0, "local": 1}  # the order of decode()'s rope_tables


class DecoderStack:
    """The layers of one model as the extension's ``DecoderStack``; :meth:`decode` runs a
    decode step through them."""

    def __init__(self, stack: Any, backend: TorchAttention) -> None:
        self._stack = stack
        self._backend = backend

    @classmethod
    def of(cls, model: DecoderModel) -> DecoderStack | None:
        """The stack of ``model``'s layers, or None where it does not qualify (see the
        module's docstring)."""
        if not isinstance(model.kernels, CpuKernels) or len(model.layers) == 0:
            return None
        ops = cpu_extension()
        if ops is None:
            return None
        parts = [_parts(layer) for layer in model.layers]
        if any(p is None for p in parts):
            return None
        layers = [p for p in parts if p is not None]
        backend = layers[0][1].backend
        if not isinstance(backend, TorchAttention) or backend.cpu_ops is None:
            return None
        cfg = model.config
        stack = ops.DecoderStack(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            cfg.norm_offset,
            cfg.residual_scale,
            cfg.activation == "gelu_tanh",
        )
        for layer, attn, mlp in layers:
            matrices = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            blocks = [m.blocks for m in matrices if m.blocks is not None]
            head_norms = attn.qk_norm == "head"
            stack.add_layer(
                layer.input_layernorm.weight.data,
                layer.post_attention_layernorm.weight.data,
                attn.q_norm.weight.data if head_norms else None,
                attn.k_norm.weight.data if head_norms else None,
                [b.data for b in blocks],
                [KIND_IDS[b.kind] for b in blocks],
                [None if m.bias is None else m.bias.data for m in matrices],
                cfg.hidden_size,
                cfg.intermediate_size,
                -1 if attn.rope is None else _TABLES[attn.rope],
                attn.layer.scale,
                attn.layer.sliding_window or 0,
                attn.layer.softcap or 0.0,
            )
        return cls(stack, backend)

    def clock_matmuls(self, on: bool) -> None:
        """Time the block matmuls of each decode step (off by default; a benchmark's)."""
        self._stack.clock_matmuls(on)

    def take_matmul_seconds(self) -> float:
        """Seconds the clocked matmuls took since the last call."""
        seconds: float = self._stack.take_matmul_seconds()
        return seconds

    def decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_tables: list[torch.Tensor],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(block output, residual)`` of the last layer for the embeddings ``x``, or None
        when the step is not decode rows alone (the Python layers run it). ``rope_tables``:
        the model's global RoPE table, then its local one if it has one."""
        paged = self._backend.whole_decode(meta)
        if paged is None:
            return None
        block_tables, seq_lens, block_size = paged
        out: tuple[torch.Tensor, torch.Tensor] = self._stack.decode(
            x,
            kv_caches,
            rope_tables,
            positions.to(torch.int64).contiguous(),
            meta.slot_mapping,
            block_tables,
            seq_lens,
            block_size,
        )
        return out


def _parts(layer: Any) -> tuple[DecoderLayer, Attention, GatedMLP] | None:
    """A layer the stack runs, its attention and its MLP; None for any other layer."""
    if type(layer) is not DecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or attn.qk_norm not in ("none", "head"):
        return None
    if type(mlp) is not GatedMLP:
        return None
    matrices = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(m.blocks is None for m in matrices):
        return None
    return layer, attn, mlp
