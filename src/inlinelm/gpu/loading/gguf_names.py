"""Which Hugging Face tensor each GGUF tensor is, family by family.

The GGUF side is the gguf package's own (llama.cpp's) naming: ``gguf.get_tensor_name_map``
maps a transformers name to the tensor of ``gguf.MODEL_TENSORS[arch]`` that llama.cpp's
converter writes for it. A :class:`Family` lists the names transformers saves for one layer
of the family (its config.json's ``model_type``); :class:`TensorNames` runs each through the
map and keeps the reverse, GGUF name -> transformers name. Experts, which llama.cpp stacks
into one ``[experts, out, in]`` tensor per projection, map to one name per expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_ATTENTION = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_SANDWICH_NORMS = (*_NORMS, "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
_LM_HEAD = "lm_head.weight"
_GLOBALS = ("model.embed_tokens.weight", "model.norm.weight", _LM_HEAD)
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True, slots=True)
class Family:
    """A model family as llama.cpp writes it into a GGUF file.

    ``layer`` holds the transformers names of one layer's tensors (under
    ``model.layers.{bid}.``), ``experts`` those of one expert's projections (``{xid}`` the
    expert), each a slice of the stacked tensor llama.cpp writes. What llama.cpp's converter
    changed, to be undone: ``permuted``, the Q/K rows of each head interleaved (its
    ``LlamaModel.permute``); ``norm_offset``, added to every norm (Gemma stores ``1 + w``
    for transformers' ``w``). ``projection_qk_norm``: the Q/K norms span the whole projection
    (OLMo 2), not one head. ``config_tensors``: the ``gguf.MODEL_TENSOR`` names of tensors
    that hold config, not weights (Phi-3's long-RoPE factors).
    """

    model_type: str
    arch: str
    layer: tuple[str, ...]
    experts: tuple[str, ...] = ()
    permuted: bool = False
    norm_offset: float = 0.0
    projection_qk_norm: bool = False
    config_tensors: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "llama", (*_NORMS, *_ATTENTION, *_MLP), permuted=True),
        Family(
            "mixtral",
            "llama",
            (*_NORMS, *_ATTENTION, "block_sparse_moe.gate.weight"),
            experts=tuple(f"block_sparse_moe.experts.{{xid}}.w{i}.weight" for i in (1, 2, 3)),
            permuted=True,
        ),
        Family(
            "qwen2",
            "qwen2",
            (*_NORMS, *_ATTENTION, *(f"self_attn.{p}_proj.bias" for p in "qkv"), *_MLP),
        ),
        Family("qwen3", "qwen3", (*_NORMS, *_ATTENTION, *_QK_NORMS, *_MLP)),
        Family(
            "qwen3_moe",
            "qwen3moe",
            (*_NORMS, *_ATTENTION, *_QK_NORMS, "mlp.gate.weight"),
            experts=tuple(f"mlp.experts.{{xid}}.{p}_proj.weight" for p in ("gate", "up", "down")),
        ),
        Family("gemma2", "gemma2", (*_SANDWICH_NORMS, *_ATTENTION, *_MLP), norm_offset=1.0),
        Family(
            "gemma3_text",
            "gemma3",
            (*_SANDWICH_NORMS, *_ATTENTION, *_QK_NORMS, *_MLP),
            norm_offset=1.0,
        ),
        Family(
            "phi3",
            "phi3",
            (
                *_NORMS,
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight",
            ),
            config_tensors=("ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT"),
        ),
        Family(
            "olmo2",
            "olmo2",
            (_NORMS[1], _SANDWICH_NORMS[3], *_ATTENTION, *_QK_NORMS, *_MLP),
            projection_qk_norm=True,
        ),
        Family("granite", "granite", (*_NORMS, *_ATTENTION, *_MLP), permuted=True),
    )
}
"""Every family a GGUF file converts to, by transformers' ``model_type``."""

SUPPORTED_GGUF_ARCHS = tuple(dict.fromkeys(f.arch for f in FAMILIES.values()))
"""The ``general.architecture`` values we convert."""


def family_of(arch: str, num_experts: int) -> Family:
    """The family of a supported ``arch``: llama.cpp writes Mixtral as a llama with experts."""
    families = [f for f in FAMILIES.values() if f.arch == arch]
    return next((f for f in families if bool(f.experts) == (num_experts > 0)), families[0])


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One GGUF tensor of a family: its kind (a ``gguf.MODEL_TENSOR``) and the transformers
    name it becomes (``{bid}`` the layer; with ``stacked``, ``{xid}`` the expert)."""

    kind: Any
    hf_name: str
    stacked: bool = False

    @property
    def is_norm(self) -> bool:
        return self.hf_name.endswith("norm.weight")


class TensorNames:
    """The GGUF tensors of one family, each with the transformers tensor it becomes."""

    def __init__(self, family: Family) -> None:
        import gguf

        self.family = family
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.arch)
        # NOTE: one block is enough: a layer's names differ only in the block number.
        self._map = gguf.get_tensor_name_map(arch, 1)
        # NOTE: an architecture without an output tensor (Gemma 2) always ties it.
        names = [n for n in _GLOBALS if n != _LM_HEAD or self._map.get_type_and_name("lm_head")]
        self.globals = {self._gguf_name(n): GgufTensor(self._kind(n), n) for n in names}
        self.layer = {self._layer_name(n): self._layer_tensor(n) for n in family.layer}
        self.layer |= {self._layer_name(n): self._layer_tensor(n) for n in family.experts}
        self.config = {
            f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]]}.weight" for kind in family.config_tensors
        }

    def lookup(self, name: str) -> tuple[int | None, GgufTensor] | None:
        """``name``'s block (None for a global tensor) and tensor; None if the family has
        no such tensor."""
        if name in self.globals:
            return None, self.globals[name]
        match = _BLOCK.match(name)
        if match and match.group(2) in self.layer:
            return int(match.group(1)), self.layer[match.group(2)]
        return None

    def layer_names(self, bid: int) -> list[str]:
        """The GGUF names of block ``bid``'s tensors."""
        return [f"blk.{bid}.{suffix}" for suffix in self.layer]

    def _layer_tensor(self, hf_suffix: str) -> GgufTensor:
        name = f"model.layers.{{bid}}.{hf_suffix}"
        kind = self._kind(self._first_block(hf_suffix))
        return GgufTensor(kind, name, stacked="{xid}" in hf_suffix)

    def _layer_name(self, hf_suffix: str) -> str:
        return self._gguf_name(self._first_block(hf_suffix)).removeprefix("blk.0.")

    @staticmethod
    def _first_block(hf_suffix: str) -> str:
        # llama.cpp maps a stacked tensor by the name of its projection, without the expert
        return f"model.layers.0.{hf_suffix.replace('.{xid}', '')}"

    def _gguf_name(self, hf_name: str) -> str:
        base, _, suffix = hf_name.rpartition(".")
        found = self._map.get_type_and_name(base)
        assert found is not None, f"gguf maps no {self.family.arch} tensor to {hf_name}"
        return f"{found[1]}.{suffix}"

    def _kind(self, hf_name: str) -> Any:
        found = self._map.get_type_and_name(hf_name.rpartition(".")[0])
        assert found is not None, f"gguf maps no {self.family.arch} tensor to {hf_name}"
        return found[0]


@dataclass(frozen=True, slots=True)
class Dims:
    """The sizes the metadata gives the tensors."""

    vocab: int
    hidden: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    expert_ff: int = 0


def tensor_shape(tensor: GgufTensor, suffix: str, dims: Dims, family: Family) -> tuple[int, ...]:
    """The (numpy-order) shape ``dims`` give ``tensor`` (``suffix``: ``weight`` or ``bias``)."""
    import gguf

    T = gguf.MODEL_TENSOR
    hidden_norms = (
        T.OUTPUT_NORM,
        T.ATTN_NORM,
        T.ATTN_POST_NORM,
        T.FFN_NORM,
        T.FFN_PRE_NORM,
        T.FFN_POST_NORM,
    )
    h, q, kv = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    experts, eff = dims.experts, dims.expert_ff
    # NOTE: Phi-3's ffn_up is transformers' fused gate_up_proj: gate rows, then up rows.
    up = 2 * dims.ff if tensor.hf_name.endswith("gate_up_proj.weight") else dims.ff
    q_norm, k_norm = (q, kv) if family.projection_qk_norm else (dims.head_dim, dims.head_dim)
    shapes: dict[Any, tuple[int, ...]] = {
        T.TOKEN_EMBD: (dims.vocab, h),
        T.OUTPUT: (dims.vocab, h),
        **dict.fromkeys(hidden_norms, (h,)),
        T.ATTN_Q: (q, h),
        T.ATTN_K: (kv, h),
        T.ATTN_V: (kv, h),
        T.ATTN_QKV: (q + 2 * kv, h),
        T.ATTN_OUT: (h, q),
        T.ATTN_Q_NORM: (q_norm,),
        T.ATTN_K_NORM: (k_norm,),
        T.FFN_GATE: (dims.ff, h),
        T.FFN_UP: (up, h),
        T.FFN_DOWN: (h, dims.ff),
        T.FFN_GATE_INP: (experts, h),
        T.FFN_GATE_EXP: (experts, eff, h),
        T.FFN_UP_EXP: (experts, eff, h),
        T.FFN_DOWN_EXP: (experts, h, eff),
    }
    shape = shapes[tensor.kind]
    return shape[:1] if suffix == "bias" else shape
