"""Every GGUF weight type the CPU engine is asked to run: a file whose linear weights (and
embedding) are stored in it loads, its tensors come out as gguf-py dequantizes them, and
with ``quantization="auto"`` every linear layer runs int8 and computes the model of its
int8 weights.

The legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from a tiny Llama by gguf-py
itself. gguf-py has no quantizer for the K-quants (Q4_K, Q5_K, Q6_K), so their blocks are
random bytes with a float16 scale of our choosing: any bytes are a valid block, and a file
of them is a model whose weights are what the blocks decode to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.loading.quantization import INT8_SCALE, stored_types
from inlinelm.gpu.model.cpu_extension import cpu_extension
from inlinelm.gpu.model.layers.int8 import quantize_groups
from inlinelm.gpu.model.layers.linear import Linear
from tests.conftest import make_tiny_model
from tests.gpu.loading.gguf_writer import F32, write_family_gguf
from tests.gpu.model.test_int8 import fake_quantized
from tests.gpu.reference import folder_tensors, load_ours, logits_atol, prefill_logits

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
def test_a_file_of_each_type_loads_as_gguf_dequantizes_it_and_runs_int8(
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
    for name, gguf_name in (
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight"),
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
    ):
        t = stored[gguf_name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        got = tensors[name]
        assert torch.isfinite(got).all() and got.abs().max() > 0
        if "q_proj" in name:
            want = _unpermute(want, SHAPE["num_attention_heads"])
        assert torch.equal(got, want), name
    # with "auto", every linear layer (the tied LM head too) runs int8, computing the
    # model of its int8 weights
    ours = load_ours(converted, "auto")
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert linears and all(m.is_int8 for m in linears)
    ids = list(range(5, 45))
    want = prefill_logits(fake_quantized(converted), ids)
    torch.testing.assert_close(
        prefill_logits(ours, ids), want, rtol=0.0, atol=logits_atol(ours.config, want)
    )
    assert not any(
        m.is_int8 for m in load_ours(converted, "none").modules() if isinstance(m, Linear)
    )
    # the int8 conversion keeps each quantized matrix as the int8 rows and scales the
    # engine computes with (nothing left to quantize at a start), and computes the same
    # model to the bit
    kept = resolve_model(str(path), int8=True).folder
    assert kept != converted
    int8_tensors = folder_tensors(kept)
    for name in weights:
        # a Q8_0 file's own values and block scales; any other type's rows quantized
        groups = tensors[name].shape[1] // 32 if qtype == "Q8_0" else 1
        q, scale = quantize_groups(tensors[name], groups)
        assert int8_tensors[name].dtype == torch.int8, name
        assert torch.equal(int8_tensors[name], q) and torch.equal(
            int8_tensors[name + INT8_SCALE], scale
        )
    norm = "model.norm.weight"
    assert int8_tensors[norm].dtype == torch.float32 and torch.equal(
        int8_tensors[norm], tensors[norm]
    )
    assert torch.equal(prefill_logits(load_ours(kept, "auto"), ids), prefill_logits(ours, ids))


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's ``LlamaModel.permute`` (each head's rotary halves
    interleaved, row by row)."""
    rows = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, rows // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
