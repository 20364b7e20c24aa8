"""The encoder models (BERT, XLM-RoBERTa, ModernBERT) against transformers on tiny random
checkpoints: ragged batches give each sequence's hidden states as it alone gets them from
transformers, the classifier heads give transformers' logits, and bad folders fail naming
what is wrong. Also checks that the fixtures load in sentence-transformers.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.model.encoders.config import (
    ENCODER_MODEL_TYPES,
    Activation,
    EncoderConfig,
    is_encoder_config,
    parse_encoder_config,
    read_encoder_config,
)
from inlinelm.gpu.model.encoders.linear import EncoderLinear
from inlinelm.gpu.model.encoders.loading import checkpoint_key, load_encoder
from inlinelm.gpu.model.encoders.model import EncoderModel, WeightTarget
from inlinelm.gpu.model.encoders.ragged import RaggedBatch
from inlinelm.gpu.model.layers.linear import onednn_packing_available
from tests.pooling import builders

CPU = torch.device("cpu")
EPS = torch.finfo(torch.float32).eps

Sequence = tuple[list[int], list[int]]
"""One input: its token ids and token type ids."""

TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    " ".join(builders.WORDS[:40]),
    "what is the capital city of the world?",
)
PAIRS = (
    ("a query about music", "a passage about songs and the history of music"),
    ("why is the river blue", " ".join(builders.WORDS[40:70])),
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A builder's folder, built once per module for each (builder, options)."""
    built: dict[str, Path] = {}

    def get(build: Callable[..., Path], **options: Any) -> Path:
        key = f"{build.__name__}-{sorted(options.items())}"
        if key not in built:
            built[key] = build(tmp_path_factory.mktemp(build.__name__), **options)
        return built[key]

    return get


def tolerance(cfg: EncoderConfig, reference: torch.Tensor, extra_layers: int = 0) -> float:
    """How far two float32 implementations of the same model may differ.

    Each layer feeds every output element through dot products of at most ``K`` terms
    (``K`` the widest of hidden, intermediate and sequence length). Summed in different
    orders (other kernels, other blocking), the two results differ by rounding errors that
    grow like ``sqrt(K) * eps`` relative to the terms' size (the probabilistic rounding
    bound of Higham and Mary, 2019; the worst case ``K * eps`` is never approached by
    independent roundings), and the layer norms keep each layer's activations at the
    reference's scale, so the layers' errors add: ``num_layers * sqrt(K) * eps *
    max|reference|`` (``extra_layers``: a classifier head's). Here that is ~1e-5 against
    an observed ~5e-7; a wrong activation variant or norm epsilon moves outputs by ~5e-5,
    a wrong position, window or RoPE base by 1e-2 or more.
    """
    width = max(cfg.hidden_size, cfg.intermediate_size, builders.MAX_LEN)
    scale = reference.abs().max().item()
    return (cfg.num_layers + extra_layers) * width**0.5 * EPS * scale


def tokenized(folder: Path) -> list[Sequence]:
    """Mixed-length inputs from the folder's tokenizer: single texts, pairs (second-text
    token types), and the one- and two-token inputs of only the special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    encodings = [tok(text) for text in TEXTS] + [tok(a, b) for a, b in PAIRS]
    seqs = [
        (list(e["input_ids"]), list(e.get("token_type_ids") or [0] * len(e["input_ids"])))
        for e in encodings
    ]
    cls, sep = tok.cls_token_id, tok.sep_token_id
    return [([cls], [0]), *seqs, ([cls, sep], [0, 0])]


def run_ours(model: EncoderModel, seqs: list[Sequence]) -> torch.Tensor:
    ids = torch.tensor([t for s in seqs for t in s[0]])
    types = torch.tensor([t for s in seqs for t in s[1]])
    with torch.inference_mode():
        return model(ids, types, [len(s[0]) for s in seqs])


def run_reference(hf_model: Any, seq: Sequence, cfg: EncoderConfig) -> Any:
    """Transformers' output for one sequence alone (no padding, no mask)."""
    inputs = {"input_ids": torch.tensor([seq[0]])}
    if cfg.model_type == "bert":
        inputs["token_type_ids"] = torch.tensor([seq[1]])
    with torch.inference_mode():
        return hf_model(**inputs)


def reference_model(folder: Path, classifier: bool) -> Any:
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModel
    return auto.from_pretrained(str(folder), dtype=torch.float32).eval()


def split_rows(hidden: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    return list(hidden.split([len(s[0]) for s in seqs]))


# -- hidden states --------------------------------------------------------------------------


ENCODERS = {
    "bert": builders.make_bert,
    "roberta": builders.make_roberta,
    "xlm-roberta": builders.make_xlm_roberta,
    "modernbert": builders.make_modernbert,
}


@pytest.mark.parametrize("model_type", ENCODER_MODEL_TYPES)
def test_ragged_batch_matches_each_sequence_alone(
    folders: Callable[..., Path], model_type: str
) -> None:
    folder = folders(ENCODERS[model_type])
    cfg = read_encoder_config(folder)
    model = load_encoder(folder, cfg, torch.float32, CPU)
    reference = reference_model(folder, classifier=False)
    seqs = tokenized(folder)
    lengths = [len(s[0]) for s in seqs]
    assert min(lengths) == 1 and max(lengths) > 2 * builders.MODERNBERT_WINDOW, lengths
    for seq, ours in zip(seqs, split_rows(run_ours(model, seqs), seqs), strict=True):
        expected = run_reference(reference, seq, cfg).last_hidden_state[0]
        torch.testing.assert_close(ours, expected, rtol=0, atol=tolerance(cfg, expected))


def test_token_types_reach_bert(folders: Callable[..., Path]) -> None:
    """A pair's second-text token types change BERT's output (the test above would pass
    with them ignored only if they did not)."""
    folder = folders(builders.make_bert)
    model = load_encoder(folder, read_encoder_config(folder), torch.float32, CPU)
    pair = tokenized(folder)[-2]
    assert 1 in pair[1]
    typed = run_ours(model, [pair])
    untyped = run_ours(model, [(pair[0], [0] * len(pair[0]))])
    assert (typed - untyped).abs().max() > 1e-2


def test_modernbert_window_is_in_force(folders: Callable[..., Path]) -> None:
    """On an input longer than the window, the same weights with every layer global give
    other states (so the match above holds with the window, not despite it)."""
    folder = folders(builders.make_modernbert)
    cfg = read_encoder_config(folder)
    assert cfg.layer_windows == (None, builders.MODERNBERT_WINDOW // 2) * 2
    windowed = load_encoder(folder, cfg, torch.float32, CPU)
    unwindowed = load_encoder(
        folder, _replace(cfg, layer_windows=(None,) * cfg.num_layers), torch.float32, CPU
    )
    seq = max(tokenized(folder), key=lambda s: len(s[0]))
    assert (run_ours(windowed, [seq]) - run_ours(unwindowed, [seq])).abs().max() > 1e-2


def _replace(cfg: EncoderConfig, **changes: Any) -> EncoderConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


# -- the ragged layout ----------------------------------------------------------------------


def test_ragged_batch_sorts_and_groups_the_sequences() -> None:
    """Sequences go longest first (ties in order) into contiguous groups of similar length
    that pad far less than one block of the longest; every move of rows is undone."""
    rng = random.Random(0)
    seq_lens = [rng.randint(1, 120) for _ in range(64)] + [120, 1]
    batch = RaggedBatch.of(seq_lens, CPU)
    rows = torch.arange(sum(seq_lens))
    by_length = sorted(range(len(seq_lens)), key=lambda j: -seq_lens[j])
    starts = [sum(seq_lens[:j]) for j in range(len(seq_lens))]
    expected = torch.cat([torch.arange(starts[j], starts[j] + seq_lens[j]) for j in by_length])
    assert torch.equal(batch.sort(rows), expected)
    assert torch.equal(batch.unsort(batch.sort(rows)), rows)
    sorted_lens = [seq_lens[j] for j in by_length]
    assert torch.equal(batch.positions, torch.cat([torch.arange(n) for n in sorted_lens]))

    groups = batch.groups
    assert groups[0].start == 0 and groups[-1].stop == rows.shape[0]
    assert all(a.stop == b.start for a, b in itertools.pairwise(groups))
    # uniform lengths fill half of one block of the longest; the groups pad that by at
    # most MAX_PADDING (a short group under MIN_GROUP_TOKENS aside): well under 3/4
    assert sum(g.num_seqs * g.max_len for g in groups) < 0.75 * len(seq_lens) * max(seq_lens)
    for group in groups:
        part = rows[group.start : group.stop]
        assert torch.equal(group.unpad(group.pad(part)), part)
        if group.key_mask is not None:
            assert group.key_mask.sum() == part.shape[0]


def test_equal_lengths_need_no_padding() -> None:
    batch = RaggedBatch.of([5, 5, 5], CPU)
    assert batch.order is None and len(batch.groups) == 1
    assert batch.groups[0].slots is None and batch.groups[0].attention_mask(None) is None


# -- classifiers ----------------------------------------------------------------------------


CLASSIFIERS: dict[str, tuple[Callable[..., Path], dict[str, Any]]] = {
    "bert-cross-encoder": (builders.make_bert_cross_encoder, {}),
    "bert-3-labels": (builders.make_bert, {"classifier": True, "num_labels": 3}),
    "xlm-roberta": (builders.make_xlm_roberta, {"classifier": True}),
    "roberta": (builders.make_roberta, {"classifier": True}),
    "modernbert-cls": (builders.make_modernbert, {"classifier": True}),
    "modernbert-mean": (
        builders.make_modernbert,
        {"classifier": True, "num_labels": 2, "classifier_pooling": "mean"},
    ),
}


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_classify_matches_transformers_logits(folders: Callable[..., Path], name: str) -> None:
    build, options = CLASSIFIERS[name]
    folder = folders(build, **options)
    cfg = read_encoder_config(folder)
    assert cfg.classifier and cfg.num_labels == options.get("num_labels", 1)
    model = load_encoder(folder, cfg, torch.float32, CPU)
    reference = reference_model(folder, classifier=True)
    seqs = tokenized(folder)
    with torch.inference_mode():
        logits = model.classify(run_ours(model, seqs), [len(s[0]) for s in seqs])
    expected = torch.cat([run_reference(reference, s, cfg).logits for s in seqs])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits, expected, rtol=0, atol=tolerance(cfg, expected, extra_layers=2)
    )


def test_classify_without_a_classifier_raises(folders: Callable[..., Path]) -> None:
    folder = folders(builders.make_bert)
    model = load_encoder(folder, read_encoder_config(folder), torch.float32, CPU)
    hidden = run_ours(model, [([2, 3], [0, 0])])
    with pytest.raises(ValueError, match="no sequence-classification head"):
        model.classify(hidden, [2])


# -- configs --------------------------------------------------------------------------------


def test_max_model_len_per_family(folders: Callable[..., Path]) -> None:
    for build in ENCODERS.values():
        cfg = read_encoder_config(folders(build))
        assert cfg.max_model_len == builders.MAX_LEN, cfg.model_type
    xlmr = read_encoder_config(folders(builders.make_xlm_roberta))
    assert xlmr.max_position_embeddings == builders.MAX_LEN + xlmr.pad_token_id + 1


def test_hub_modernbert_config_reads_as_transformers_5_writes_it() -> None:
    """Configs on the Hub give the layer pattern and the RoPE bases in the old fields."""
    shape = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96}
    old = {
        **shape,
        "model_type": "modernbert",
        "vocab_size": 50,
        "num_hidden_layers": 4,
        "global_attn_every_n_layers": 3,
        "local_attention": 128,
        "global_rope_theta": 160000.0,
        "local_rope_theta": 10000.0,
    }
    cfg = parse_encoder_config(old, "config.json")
    assert cfg.layer_windows == (None, 64, 64, None)
    assert (cfg.global_rope_theta, cfg.local_rope_theta) == (160000.0, 10000.0)


def test_unsupported_model_type_is_not_an_encoder(tmp_path: Path) -> None:
    assert not is_encoder_config({"model_type": "llama"})
    assert not is_encoder_config({})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="model_type"):
        read_encoder_config(tmp_path)


# -- weights --------------------------------------------------------------------------------


def test_sharded_checkpoint_loads(folders: Callable[..., Path], tmp_path: Path) -> None:
    from transformers import AutoModel

    source = folders(builders.make_bert)
    AutoModel.from_pretrained(str(source)).save_pretrained(str(tmp_path), max_shard_size="20KB")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg = read_encoder_config(tmp_path)
    whole = load_encoder(source, cfg, torch.float32, CPU)
    sharded = load_encoder(tmp_path, cfg, torch.float32, CPU)
    for (name, a), (_, b) in zip(whole.named_parameters(), sharded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def _rewrite_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_folder(source: Path, dest: Path) -> Path:
    for path in source.iterdir():
        if path.is_file():
            (dest / path.name).write_bytes(path.read_bytes())
    return dest


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (builders.make_bert_cross_encoder, "bert.encoder.layer.1.attention.self.key.weight"),
        (builders.make_modernbert, "layers.1.attn_norm.weight"),
    ],
)
def test_missing_tensor_is_named(
    folders: Callable[..., Path], tmp_path: Path, build: Callable[..., Path], name: str
) -> None:
    folder = _copy_folder(folders(build), tmp_path)
    _rewrite_weights(folder, lambda tensors: tensors.pop(name))
    with pytest.raises(ModelLoadError, match="missing") as error:
        load_encoder(folder, read_encoder_config(folder), torch.float32, CPU)
    assert name.removeprefix("bert.") in str(error.value)


def test_misshapen_tensor_is_named(folders: Callable[..., Path], tmp_path: Path) -> None:
    folder = _copy_folder(folders(builders.make_xlm_roberta), tmp_path)
    name = "embeddings.position_embeddings.weight"

    def shorten(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:-1].clone()

    _rewrite_weights(folder, shorten)
    with pytest.raises(ModelLoadError, match="shape mismatch") as error:
        load_encoder(folder, read_encoder_config(folder), torch.float32, CPU)
    assert name in str(error.value)


def test_checkpoint_names_with_prefixes_and_old_layer_norm_names() -> None:
    norm = "embeddings.LayerNorm.weight"
    targets = {norm: WeightTarget("embed_norm.weight"), "classifier.weight": WeightTarget("x")}
    assert checkpoint_key("bert.embeddings.LayerNorm.gamma", targets) == norm
    assert checkpoint_key("roberta.embeddings.LayerNorm.weight", targets) == norm
    assert checkpoint_key("classifier.weight", targets) == "classifier.weight"
    assert checkpoint_key("cls.predictions.decoder.weight", targets) is None


def test_forward_rejects_lengths_that_do_not_split_the_tokens(
    folders: Callable[..., Path],
) -> None:
    folder = folders(builders.make_bert)
    model = load_encoder(folder, read_encoder_config(folder), torch.float32, CPU)
    ids = torch.tensor([2, 5, 3])
    for seq_lens in ([2], [3, 0], [], [builders.MAX_LEN + 1]):
        with pytest.raises(ValueError):
            model(ids, None, seq_lens)


# -- the fixtures in sentence-transformers ----------------------------------------------------


def test_fixtures_load_in_sentence_transformers(
    folders: Callable[..., Path], tmp_path: Path
) -> None:
    """Each sentence-transformers folder loads there, with its prompts; the CLS-pooled
    BERT's embedding is our first row; the cross-encoder and the reranker load."""
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for build, pooling in (
        (builders.make_xlm_roberta, "mean"),
        (builders.make_modernbert, "mean"),
    ):
        folder = folders(build, sentence_transformers=pooling, normalize=True)
        assert st.SentenceTransformer(str(folder), device="cpu").prompts["query"] == "query: "
    embedder = st.SentenceTransformer(str(folders(builders.make_qwen3_embedder)), device="cpu")
    vectors = embedder.encode(["hello world", "the quick brown fox"], convert_to_tensor=True)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(2))

    folder = folders(builders.make_bert, sentence_transformers="cls")
    text = "the quick brown fox"
    embedding = st.SentenceTransformer(str(folder), device="cpu").encode(
        [text], convert_to_tensor=True
    )[0]
    cfg = read_encoder_config(folder)
    model = load_encoder(folder, cfg, torch.float32, CPU)
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    first = run_ours(model, [(ids, [0] * len(ids))])[0]
    torch.testing.assert_close(embedding, first, rtol=0, atol=tolerance(cfg, embedding))

    scores = st.CrossEncoder(str(folders(builders.make_bert_cross_encoder)), device="cpu").predict(
        [("a query", "a passage")]
    )
    assert scores.shape == (1,)

    reranker = folders(builders.make_qwen3_reranker)
    tok = AutoTokenizer.from_pretrained(str(reranker))
    assert [len(tok(w, add_special_tokens=False)["input_ids"]) for w in ("yes", "no")] == [1, 1]
    AutoModelForCausalLM.from_pretrained(str(reranker))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_onednn_linear_matches_plain(activation: Activation) -> None:
    """The packed layer's fused activation and residual add equal the plain ops."""
    if not onednn_packing_available(CPU, torch.float32):
        pytest.skip("this torch has no oneDNN linear")
    torch.manual_seed(0)
    plain, packed = EncoderLinear(16, 24, bias=True), EncoderLinear(16, 24, bias=True)
    for layer in (plain, packed):
        layer.weight.data = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
        assert layer.bias is not None
        layer.bias.data = torch.randn(24, generator=torch.Generator().manual_seed(2))
    assert packed.pack()
    x, residual = torch.randn(5, 16), torch.randn(5, 24)
    with torch.inference_mode():
        pairs = [
            (packed(x), plain(x)),
            (packed(x, residual=residual), plain(x, residual=residual)),
            (packed.activated(x, activation), plain.activated(x, activation)),
        ]
    for got, expected in pairs:
        # one 16-term dot product and one activation: sqrt(K) roundings of the output's size
        atol = 16**0.5 * EPS * expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)
