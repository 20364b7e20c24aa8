"""Every family llama.cpp writes as GGUF converts back to the Hugging Face folder it was
written from: the same tensors (exactly from float32; from Q8_0 within its rounding), a
config.json that parses to the same ModelConfig, a tokenizer that encodes alike; and the
engine on the .gguf file decodes as on the folder (exactly from float32; from Q8_0 apart
only where the quantization can flip a near-tie).

The files are written as llama.cpp's converter writes them (``gguf_writer``) from the tiny
family models of ``tests/gpu/families.py``, changed only where a GGUF file cannot say what
the tiny model does (:data:`GGUF_CHANGES`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inlinelm import Engine, SamplingParams
from inlinelm.errors import ModelLoadError
from inlinelm.gpu.loading.gguf_names import FAMILIES, TensorNames, family_of
from inlinelm.gpu.loading.model_files import resolve_model
from inlinelm.gpu.loading.quantization import stored_types
from inlinelm.gpu.model.layers.linear import Linear
from inlinelm.gpu.model.registry import parse_config
from tests.conftest import make_tiny_model
from tests.gpu.families import FAMILY_CONFIGS
from tests.gpu.loading.gguf_writer import F32, GGUF_ARCHS, Q8_0, write_family_gguf
from tests.gpu.reference import folder_tensors, load_ours, load_reference

GGUF_CHANGES: dict[str, dict[str, Any]] = {
    # llama.cpp runs Mixtral as the llama architecture, which has no sliding window
    "mixtral": {"sliding_window": None},
    # llama.cpp's qwen3moe has experts in every layer (gguf has no dense FFN tensor for it)
    "qwen3_moe": {"mlp_only_layers": []},
    # no key holds the query scale: llama.cpp takes the head size (hidden / heads at 27B)
    "gemma2": {"query_pre_attn_scalar": 32},
    # no key holds the layer pattern: llama.cpp makes every sixth layer full attention
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": None},
}
"""How each family's tiny model differs for its GGUF file, and why."""
GGUF_FAMILIES = tuple(GGUF_ARCHS)
QTYPES = {"F32": F32, "Q8_0": Q8_0}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far into the woods",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
]
"""Longer than the windows (8 tokens) and, with the new tokens, than Phi-3's original
context (24), so both cut in while decoding."""
NEW_TOKENS = 16
TIE_MARGIN = 1e-3
"""A top-2 logprob gap under which float32 rounding alone may flip a greedy token."""
Greedy = list[tuple[list[int], list[float]]]
"""Per prompt: the greedy tokens and the top-2 logprob gap at each position."""


class Models:
    """The module's tiny models, each built once: each family's folder, its GGUF files and
    what resolve_model converted them into."""

    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self._folders: dict[str, Path] = {}
        self._types: dict[tuple[str, str], dict[str, gguf.GGMLQuantizationType]] = {}
        self._greedy: dict[str, Greedy] = {}

    def folder(self, family: str) -> Path:
        if family not in self._folders:
            folder = self.root / family
            options = FAMILY_CONFIGS[family] | GGUF_CHANGES.get(family, {})
            make_tiny_model(folder, self.tokenizer_dir, **options)
            _vary_norms(folder, offset=family in ("gemma2", "gemma3_text"))
            self._folders[family] = folder
        return self._folders[family]

    def gguf(self, family: str, qtype: str) -> Path:
        path = self.root / f"{family}-{qtype}.gguf"
        if (family, qtype) not in self._types:
            self._types[family, qtype] = write_family_gguf(self.folder(family), path, QTYPES[qtype])
        return path

    def tensor_types(self, family: str, qtype: str) -> dict[str, gguf.GGMLQuantizationType]:
        """The type each tensor of the GGUF file is stored in, by GGUF name."""
        self.gguf(family, qtype)
        return self._types[family, qtype]

    def folder_greedy(self, family: str) -> Greedy:
        """The engine's :func:`greedy` on the family's folder (run once)."""
        if family not in self._greedy:
            self._greedy[family] = greedy(self.folder(family))
        return self._greedy[family]

    def converted(self, family: str, qtype: str) -> Path:
        return resolve_model(str(self.gguf(family, qtype))).folder


def _vary_norms(folder: Path, *, offset: bool) -> None:
    """Give every norm its own weights (transformers starts them all at 1, Gemma's at 0),
    so a norm read in another's place shows. Multiples of 2^-8: exact in float32, and so
    are Gemma's ``1 + w`` in the file and ``w`` back."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            steps = torch.randint(-64, 65, tensor.shape, generator=generator)
            tensors[name] = steps.float() / 256 + (0.0 if offset else 1.0)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Models]:
    """The module's models, converted into a cache of their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INLINELM_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
        yield Models(tmp_path_factory.mktemp("gguf-families"), tokenizer_dir)


def test_every_family_name_is_a_tensor_of_its_architecture() -> None:
    # The mapping is gguf's: each transformers name maps to a tensor llama.cpp declares
    # for the architecture, and no two to the same one.
    for family in FAMILIES.values():
        names = TensorNames(family)
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
        kinds = [t.kind for t in (*names.globals.values(), *names.layer.values())]
        assert set(kinds) <= set(gguf.MODEL_TENSORS[arch]), family.model_type
        assert len(names.layer) == len(family.layer) + len(family.experts), family.model_type
    assert family_of("llama", 8).model_type == "mixtral"
    assert family_of("llama", 0).model_type == "llama"


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_the_converted_folder_is_the_source_folder(models: Models, family: str, qtype: str) -> None:
    source, converted = models.folder(family), models.converted(family, qtype)
    # 1) the tensors: every name, each within what the file's type keeps of it
    expected = load_file(str(source / "model.safetensors"))
    got = folder_tensors(converted)
    assert sorted(got) == sorted(expected)
    bounds = _rounding_bounds(models.tensor_types(family, qtype), family, expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        error = (got[name] - tensor).abs()
        assert bool((error <= bounds[name]).all()), (name, float(error.max()))
        if qtype == "F32":
            assert torch.equal(got[name], tensor), name
    # 2) the config: the ModelConfig our loader builds of each
    raw_source = json.loads((source / "config.json").read_text())
    raw_converted = json.loads((converted / "config.json").read_text())
    assert parse_config(raw_converted, "converted") == parse_config(raw_source, "source")
    # 3) the tokenizer: the prompts and the chat template alike
    from transformers import AutoTokenizer

    source_tokenizer = AutoTokenizer.from_pretrained(str(source))
    converted_tokenizer = AutoTokenizer.from_pretrained(str(converted))
    for prompt in [*PROMPTS, "<|im_start|>user\n  tabs\tand 🦙 ñ 你好<|im_end|>\n"]:
        assert converted_tokenizer(prompt).input_ids == source_tokenizer(prompt).input_ids
    assert converted_tokenizer.chat_template == source_tokenizer.chat_template


def _rounding_bounds(
    stored: dict[str, gguf.GGMLQuantizationType], family: str, expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The most each element of each tensor may move, by the type the file stores it in.

    Q8_0 rounds each block of 32 values (along a row) to ``q * d``, ``q`` an integer of at
    most 127 in size and ``d = max|block| / 127`` rounded to float16: the error is at most
    ``d / 2`` from ``q``, plus ``127 * |d - fp16(d)| <= 127 * 2^-11 * d`` from the scale
    (and 2^-24 * 127 where ``d`` is a float16 subnormal). A float16 tensor (llama.cpp's
    fallback for rows that do not split into blocks) keeps 11 bits: ``2^-11 * |x|``, or
    2^-25 below float16's normal range."""
    names = TensorNames(FAMILIES[family])
    types: dict[str, Any] = {}
    for gguf_name, kind in stored.items():
        found = names.lookup(gguf_name)
        if found is None:
            continue  # config, not a weight (Phi-3's RoPE factors)
        bid, tensor = found
        config = FAMILY_CONFIGS[family]
        for xid in range(config.get("num_local_experts") or config.get("num_experts") or 1):
            types[tensor.hf_name.format(bid=bid, xid=xid)] = kind
    bounds = {}
    for name, x in expected.items():
        kind = types[name]
        if kind == gguf.GGMLQuantizationType.F32:
            bounds[name] = torch.zeros_like(x)
        elif kind == gguf.GGMLQuantizationType.F16:
            bounds[name] = torch.clamp(x.abs() * 2**-11, min=2**-25)
        else:
            assert kind == gguf.GGMLQuantizationType.Q8_0, (name, kind)
            blocks = x.reshape(*x.shape[:-1], -1, 32)
            scale = blocks.abs().amax(-1, keepdim=True) / 127
            per_block = scale / 2 + 127 * torch.clamp(scale * 2**-11, min=2**-24)
            bounds[name] = per_block.expand_as(blocks).reshape(x.shape)
    return bounds


def greedy(model: Path) -> Greedy:
    """The engine's greedy tokens for each prompt, with the top-2 logprob gap at each: with
    the file's own values dequantized (``quantization="none"``; these tests check the
    conversion, tests/gpu/model/test_blocks.py the quantized layers)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    engine = Engine(model=str(model), num_threads=1, max_num_seqs=2, quantization="none")
    try:
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.close()
    results = []
    for out in outputs:
        gaps = [lp.logprobs[1] - lp.logprobs[2] for lp in out.logprobs or []]
        assert len(out.token_ids) == len(gaps) == NEW_TOKENS
        results.append((list(out.token_ids), gaps))
    return results


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_the_float32_file_decodes_as_its_folder(models: Models, family: str) -> None:
    expected = models.folder_greedy(family)
    assert [ids for ids, _ in greedy(models.gguf(family, "F32"))] == [ids for ids, _ in expected]


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_the_q8_0_file_decodes_as_its_folder_but_at_the_near_ties_it_may_flip(
    models: Models, family: str
) -> None:
    # Greedy tokens part only where the folder's top-2 gap is within what Q8_0 moves the
    # logprobs there: twice the largest change, measured teacher-forced on the folder's
    # own tokens (transformers on both folders), plus float32's tie margin.
    source = models.folder(family)
    expected, got = models.folder_greedy(family), greedy(models.gguf(family, "Q8_0"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    reference, quantized = load_reference(source), load_reference(models.converted(family, "Q8_0"))
    agreed, parted = 0, []
    for prompt, (ids, gaps), (q_ids, _) in zip(PROMPTS, expected, got, strict=True):
        split = next((k for k, (a, b) in enumerate(zip(ids, q_ids, strict=True)) if a != b), None)
        agreed += NEW_TOKENS if split is None else split
        if split is None:
            continue
        prompt_ids = list(tokenizer(prompt).input_ids)
        sequence = torch.tensor([prompt_ids + ids[:split]])
        with torch.inference_mode():
            logprobs = [m(sequence).logits[0, -1].log_softmax(-1) for m in (reference, quantized)]
        moved = float((logprobs[0] - logprobs[1]).abs().max())
        parted.append(f"at {split}: gap {gaps[split]:.4f}, moved {moved:.4f}")
        assert gaps[split] <= 2 * moved + TIE_MARGIN, (
            f"{family}: prompt {prompt[:20]!r} parts at token {split}, where the top-2 gap "
            f"{gaps[split]:.4f} is beyond what Q8_0 moved ({moved:.4f})"
        )
    total = NEW_TOKENS * len(PROMPTS)
    print(f"{family} Q8_0: {agreed}/{total} greedy tokens as the folder's; parted {parted}")
    assert agreed >= total // 2, f"{family}: {agreed} tokens agree"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_the_conversion_records_each_tensors_stored_type(models: Models, qtype: str) -> None:
    # What quantization="auto" reads: a Q8_0 file's linear weights were stored quantized
    # (its norms stay F32, as llama.cpp writes them); an F32 file's were not.
    types = stored_types(models.converted("qwen3", qtype))
    weights = [name for name in types if name.endswith(("proj.weight", "embed_tokens.weight"))]
    assert weights and all(types[name] == qtype for name in weights)
    assert types["model.norm.weight"] == "F32"
    model = load_ours(models.converted("qwen3", qtype), "auto")
    quantized = [m.blocks is not None for m in model.modules() if isinstance(m, Linear)]
    assert quantized and all(quantized) == (qtype == "Q8_0") == any(quantized)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_quantized_conversion_keeps_experts_float(models: Models, family: str) -> None:
    # A sparse MLP computes in float: its experts keep the file's values, where the
    # attention's matrices are the file's Q8_0 blocks.
    path = str(models.gguf(family, "Q8_0"))
    kept = folder_tensors(resolve_model(path, quantized=True).folder)
    floats = folder_tensors(models.converted(family, "Q8_0"))
    experts = [name for name in kept if ".experts." in name and name.endswith(".weight")]
    assert experts
    for name in experts:
        assert kept[name].dtype == torch.float32 and torch.equal(kept[name], floats[name]), name
    assert kept["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8


def test_yarn_rope_converts(tmp_path: Path, tokenizer_dir: Path, models: Models) -> None:
    # rope.scaling.type yarn, with its factor, original context and betas
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    }
    source = make_tiny_model(
        tmp_path / "qwen3-yarn", tokenizer_dir, **FAMILY_CONFIGS["qwen3"], rope_parameters=rope
    )
    path = tmp_path / "qwen3-yarn.gguf"
    write_family_gguf(source, path)
    raw_converted = json.loads((resolve_model(str(path)).folder / "config.json").read_text())
    raw_source = json.loads((source / "config.json").read_text())
    converted = parse_config(raw_converted, "converted")
    assert converted == parse_config(raw_source, "source")
    assert (converted.rope.rope_type, converted.rope.factor) == ("yarn", 4.0)


def test_an_unconvertible_tensor_type_is_named_for_a_new_architecture(
    models: Models, tmp_path: Path
) -> None:
    # Q8_1 is one of llama.cpp's intermediate types: gguf-py has no dequantizer for it.
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    down = np.zeros((64, 128 // block * type_size), dtype=np.uint8)  # [hidden, intermediate]
    raw = {"blk.1.ffn_down.weight": (down, gguf.GGMLQuantizationType.Q8_1)}
    path = tmp_path / "olmo2-q8_1.gguf"
    write_family_gguf(models.folder("olmo2"), path, raw=raw)
    with pytest.raises(ModelLoadError, match="Q8_1 has no dequantizer") as info:
        resolve_model(str(path))
    assert (info.value.path, info.value.field) == (str(path), "blk.1.ffn_down.weight")
