"""Every GGUF weight type the CPU engine is asked to run: a file whose linear weights (and
embedding) are stored in it loads, its tensors come out as gguf-py dequantizes them, and
with ``quantization="auto"`` every linear layer runs block-quantized, in the file's own
blocks where the kernel computes them (Q8_0, Q4_0, Q4_1), Q4_K as the Q4_1 blocks of its
sub-blocks (within float16's rounding of their scales and offsets), and as Q8_0 blocks of
its values otherwise, and computes with exactly those weights.

The legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from a tiny Llama by gguf-py
itself. gguf-py has no quantizer for the K-quants (Q4_K, Q5_K, Q6_K), so their blocks are
random bytes with a float16 scale of our choosing: any bytes are a valid block, and a file
of them is a model whose weights are what the blocks decode to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from inlinelm.gpu.loading.model_files import resolve_model, weight_files
from inlinelm.gpu.loading.quantization import BLOCKS_METADATA, block_kind, stored_types
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.layers.blocks import dequantize_blocks, quantize_q8_0
from inlinelm.gpu.model.layers.linear import Linear
from tests.conftest import make_tiny_model
from tests.gpu.loading.gguf_writer import F32, write_family_gguf
from tests.gpu.model.test_blocks import reference, spread
from tests.gpu.reference import folder_tensors, load_ours, prefill_logits

pytestmark = pytest.mark.skipif(cpu_extension() is None, reason="the CPU extension did not build")

T = gguf.GGMLQuantizationType
LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
"""Rows of 256 values: a K-quant block is a whole row (QK_K)."""

K_SCALES = {  # type -> (byte offsets of its float16 scales, their value)
    # d and dmin first; w = d * scale * q - dmin * min, 6-bit scales, 4/5-bit q
    "Q4_K": ((0, 2), 0.02 / (63 * 15)),
    "Q5_K": ((0, 2), 0.02 / (63 * 31)),
    # d last; w = d * scale * (q - 32), int8 scales, 6-bit q
    "Q6_K": ((208,), 0.02 / (128 * 32)),
}


def k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` blocks for a [rows, cols] tensor, as GGUFWriter takes raw bytes."""
    block, size = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, value = K_SCALES[qtype]
    scale = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    for offset in offsets:
        raw[:, :, offset : offset + 2] = scale
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def files(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[dict[str, Path]]:
    """A GGUF file per type of the same tiny Llama (hidden 256), converted in a cache of
    the module's own."""
    root = tmp_path_factory.mktemp("gguf-types")
    folder = make_tiny_model(root / "llama", tokenizer_dir, **SHAPE)
    plain = root / "llama-F32.gguf"
    write_family_gguf(folder, plain, F32)
    weights = {t.name: t.shape for t in gguf.GGUFReader(plain).tensors if len(t.shape) == 2}
    paths = {}
    rng = np.random.default_rng(0)
    for qtype in LEGACY + K_QUANTS:
        path = root / f"llama-{qtype}.gguf"
        if qtype in K_QUANTS:
            # NOTE: gguf-py's reader lists shapes as ggml does, the row length first
            raw = {
                name: (k_blocks(int(rows), int(cols), qtype, rng), T[qtype])
                for name, (cols, rows) in weights.items()
            }
            write_family_gguf(folder, path, F32, raw=raw)
        else:
            write_family_gguf(folder, path, T[qtype])
        paths[qtype] = path
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INLINELM_CACHE", str(tmp_path_factory.mktemp("gguf-types-cache")))
        yield paths


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS)
def test_a_file_of_each_type_loads_as_gguf_dequantizes_it_and_runs_quantized(
    files: dict[str, Path], qtype: str
) -> None:
    path = files[qtype]
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in stored.values() if len(t.shape) == 2} == {T[qtype]}
    converted = resolve_model(str(path)).folder
    # the conversion records the stored type of every linear weight and the embedding
    types = stored_types(converted)
    weights = [name for name in types if name.endswith(("proj.weight", "embed_tokens.weight"))]
    assert weights and all(types[name] == qtype for name in weights)
    # each tensor is gguf-py's dequantization of its blocks (Q rows un-permuted from
    # llama.cpp's interleaved rotary layout)
    tensors = folder_tensors(converted)
    checked = (
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight"),
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
    )
    for name, gguf_name in checked:
        t = stored[gguf_name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        got = tensors[name]
        assert torch.isfinite(got).all() and got.abs().max() > 0
        if "q_proj" in name:
            want = _unpermute(want, SHAPE["num_attention_heads"])
        assert torch.equal(got, want), name
    # the quantized conversion keeps each matrix as the blocks the engine computes with
    # (nothing left to quantize at a start): the file's own bytes for a kind the kernel
    # computes, Q4_K's sub-blocks as Q4_1 blocks, else Q8_0 blocks of its values
    kept = resolve_model(str(path), quantized=True).folder
    assert kept != converted
    kind = block_kind(qtype)
    assert kind == {"Q4_K": "Q4_1"}.get(qtype, qtype if qtype in LEGACY[:3] else "Q8_0")
    blocks, kinds = _blocks(kept)
    assert set(weights) <= set(kinds) and {kinds[name] for name in weights} == {kind}
    for name, gguf_name in checked:
        raw = torch.from_numpy(stored[gguf_name].data.copy())
        if "q_proj" in name:
            raw = _unpermute(raw, SHAPE["num_attention_heads"])
        if qtype == "Q4_K":
            got_values = dequantize_blocks(blocks[name], kind)
            assert (got_values - tensors[name]).abs().le(_q4_1_rounding(blocks[name])).all()
            continue
        want = raw if kind == qtype else quantize_q8_0(tensors[name])
        assert torch.equal(blocks[name], want), name
    norm = "model.norm.weight"
    assert blocks[norm].dtype == torch.float32 and torch.equal(blocks[norm], tensors[norm])
    # with "auto", every linear layer (the tied LM head too) holds those blocks and computes
    # with them, on the inputs a forward gives it
    ours = load_ours(kept, "auto")
    linears = {n: m for n, m in ours.named_modules() if isinstance(m, Linear)}
    assert linears and all(m.blocks is not None and m.blocks.kind == kind for m in linears.values())
    down = linears["layers.1.mlp.down_proj"]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = down.register_forward_hook(lambda m, a, out: seen.append((a[0].clone(), out.clone())))
    prefill_logits(ours, list(range(5, 45)))
    hook.remove()
    down_blocks = blocks["model.layers.1.mlp.down_proj.weight"]
    values = dequantize_blocks(down_blocks, kind)
    exact, bound = reference(seen[0][0], values, spread(down_blocks, kind), None)
    assert ((seen[0][1].double() - exact).abs() <= bound).all()
    assert torch.equal(down.blocks.dequantize(), values)
    assert not any(
        m.blocks is not None
        for m in load_ours(converted, "none").modules()
        if isinstance(m, Linear)
    )
    if qtype != "Q4_1":
        return
    # the float conversion holds no blocks: its layers (types Q4_1) load quantized to Q8_0
    floats = load_ours(converted, "auto")
    assert all(
        m.blocks is not None and m.blocks.kind == "Q8_0"
        for m in floats.modules()
        if isinstance(m, Linear)
    )


def _blocks(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a quantized conversion, and the block kind of each block tensor
    (from its shard's metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            kinds.update(json.loads((f.metadata() or {}).get(BLOCKS_METADATA, "{}")))
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors, kinds


def _q4_1_rounding(blocks: torch.Tensor) -> torch.Tensor:
    """Per weight, the most float16 rounding of a Q4_1 block's scale ``d`` and offset ``m``
    moves ``d * q + m`` (q <= 15): 2^-11 of each (relative, for normal float16) plus
    float16's subnormal step 2^-24 of each (absolute)."""
    rows = blocks.shape[0]
    halves = blocks.reshape(rows, -1, 20)[:, :, :4].contiguous().view(torch.float16).float()
    d, m = halves[:, :, 0].abs(), halves[:, :, 1].abs()
    per_block = (15 * d + m) * 2.0**-11 / (1 - 2.0**-11) + 16 * 2.0**-24
    return per_block.repeat_interleave(32, dim=1)


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's ``LlamaModel.permute`` (each head's rotary halves
    interleaved, row by row)."""
    rows = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, rows // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
