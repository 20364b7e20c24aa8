"""Tiny random-weight embedding and reranking models, built in the test (nothing is
downloaded): transformers makes each model from a small config under a fixed seed and
saves it; the ``tokenizers`` library makes a small tokenizer of the family's kind, saved
so ``AutoTokenizer.from_pretrained(folder)`` loads it.

Each builder takes a folder (created when missing) and returns it. Those with
``sentence_transformers`` (a pooling mode: ``"cls"``, ``"mean"`` or ``"lasttoken"``)
also write the sentence-transformers layout as models on the Hub have it: ``modules.json``,
``sentence_bert_config.json``, ``1_Pooling/config.json`` (the ``pooling_mode_*`` keys),
an optional ``2_Normalize`` module and ``config_sentence_transformers.json`` with prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

SEED = 0
MAX_LEN = 128
"""Every encoder fixture's longest input, in tokens."""

MODERNBERT_WINDOW = 16
"""ModernBERT's ``local_attention``: a local layer's token sees 8 tokens either side, fewer
than the longer test inputs have."""

INIT_STD = 0.1
"""Weights five times transformers' default spread, so attention is far from uniform and a
wrong position, window or mask changes the output clearly."""

PROMPTS = {"query": "query: ", "passage": "passage: "}

_WORD_LIST = """
the of and to in is was for on that with as by at from it his an were are which be this
has or had not but have one first new their its after two who they been also other all
more some her time only can when there most into over between than up such city years
three world may where school during both would state known these made then out under
while them well many area part later about through being used team so year de including
war called name he she we you what how why yes no query passage document search find
answer question model text language small large quick brown fox jumps lazy dog cat sat
mat river bank money water fire earth music song book paper science history computer
engine serving fast slow good bad red blue green white black day night house car road
"""
WORDS = tuple(_WORD_LIST.split())
"""A small fixed English word list: the vocabulary of every fixture tokenizer."""

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()"


# -- tokenizers ---------------------------------------------------------------------------


def _save_tokenizer(tok: Tokenizer, folder: Path, **specials: Any) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAX_LEN, **specials)
    fast.save_pretrained(str(folder))


def bert_tokenizer(more_words: Sequence[str] = ()) -> Tokenizer:
    """Lowercasing WordPiece, ``[PAD]`` = 0; pairs get token type 1 on their second text.
    ``more_words`` join the vocabulary after the fixed word list."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [*specials, *CHARS, *(f"##{c}" for c in CHARS), *WORDS, *more_words]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    return tok


def _save_bert_tokenizer(folder: Path) -> int:
    tok = bert_tokenizer()
    names = ("pad", "unk", "cls", "sep", "mask")
    specials = {
        f"{n}_token": t
        for n, t in zip(names, ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"), strict=True)
    }
    _save_tokenizer(
        tok, folder, **specials, model_input_names=["input_ids", "token_type_ids", "attention_mask"]
    )
    return tok.get_vocab_size()


def xlm_roberta_tokenizer() -> Tokenizer:
    """A SentencePiece-style Unigram: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3,
    whole words (``▁word``) scored above their letters; pairs ``<s> A </s> </s> B </s>``."""
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces = [("▁", -2.0), *((f"▁{w}", -3.0) for w in WORDS), *((c, -6.0) for c in CHARS)]
    vocab = [*specials, *dict.fromkeys(pieces), ("<mask>", 0.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    return tok


def _save_xlm_roberta_tokenizer(folder: Path) -> int:
    tok = xlm_roberta_tokenizer()
    _save_tokenizer(
        tok,
        folder,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
        model_input_names=["input_ids", "attention_mask"],
    )
    return tok.get_vocab_size()


def byte_bpe_tokenizer(specials: list[str], extra_words: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE trained on :data:`WORDS` (and ``extra_words``, each then one
    token), the ``specials`` first in its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # NOTE: the extra words repeat alone (no leading space) so BPE merges each into one
    # token; the word list repeats with spaces, as text has it.
    corpus = [" ".join(WORDS)] * 20 + list(extra_words) * 200
    tok.train_from_iterator(corpus, trainer)
    return tok


def _save_modernbert_tokenizer(folder: Path) -> int:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = byte_bpe_tokenizer(specials)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    names = ("pad", "unk", "cls", "sep", "mask")
    _save_tokenizer(
        tok,
        folder,
        **{f"{n}_token": t for n, t in zip(names, specials, strict=True)},
        model_input_names=["input_ids", "attention_mask"],
    )
    return tok.get_vocab_size()


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _save_qwen3_tokenizer(folder: Path, *, append_eos: bool) -> int:
    """Qwen3's kind of tokenizer: byte-level BPE, ``<|endoftext|>`` the pad and end token,
    left padding; ``append_eos`` ends each input with it (as Qwen3-Embedding's does, for
    last-token pooling). "yes" and "no" are single tokens (a reranker's answers)."""
    tok = byte_bpe_tokenizer(QWEN_SPECIALS, extra_words=("yes", "no"))
    if append_eos:
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>",
            pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", eos)],
        )
    _save_tokenizer(
        tok,
        folder,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIALS[1:],
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )
    return tok.get_vocab_size()


# -- models -------------------------------------------------------------------------------


def _encoder_shape() -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "initializer_range": INIT_STD,
    }


def _save_model(model_class: Any, config: Any, folder: Path) -> None:
    torch.manual_seed(SEED)
    model = model_class(config).eval()
    model.save_pretrained(str(folder))


def make_bert(
    folder: Path,
    *,
    classifier: bool = False,
    num_labels: int = 1,
    sentence_transformers: str | None = None,
    normalize: bool = False,
) -> Path:
    """A 2-layer BERT (hidden 32): ``BertModel``, or ``BertForSequenceClassification``."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_bert_tokenizer(folder)
    config = BertConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_LEN,
        num_labels=num_labels,
        **_encoder_shape(),
    )
    _save_model(BertForSequenceClassification if classifier else BertModel, config, folder)
    if sentence_transformers is not None:
        write_sentence_transformers(folder, sentence_transformers, 32, normalize=normalize)
    return folder


def make_roberta(folder: Path, **options: Any) -> Path:
    """A 2-layer RoBERTa: :func:`make_xlm_roberta`'s model as ``model_type`` ``roberta``."""
    return make_xlm_roberta(folder, roberta=True, **options)


def make_bert_cross_encoder(folder: Path) -> Path:
    """A BERT cross-encoder: ``BertForSequenceClassification`` with one label."""
    return make_bert(folder, classifier=True, num_labels=1)


def make_xlm_roberta(
    folder: Path,
    *,
    classifier: bool = False,
    num_labels: int = 1,
    sentence_transformers: str | None = None,
    normalize: bool = False,
    roberta: bool = False,
) -> Path:
    """A 2-layer XLM-RoBERTa (hidden 32, one token type, positions from ``pad + 1``);
    with ``roberta``, the same as a RoBERTa (``model_type`` ``roberta``)."""
    import transformers

    prefix = "Roberta" if roberta else "XLMRoberta"
    config_class = getattr(transformers, f"{prefix}Config")
    head = "ForSequenceClassification" if classifier else "Model"
    model_class = getattr(transformers, f"{prefix}{head}")

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_xlm_roberta_tokenizer(folder)
    config = config_class(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_LEN + 2,  # positions start at pad_token_id + 1 = 2
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=num_labels,
        **_encoder_shape(),
    )
    _save_model(model_class, config, folder)
    if sentence_transformers is not None:
        write_sentence_transformers(folder, sentence_transformers, 32, normalize=normalize)
    return folder


def make_modernbert(
    folder: Path,
    *,
    classifier: bool = False,
    num_labels: int = 1,
    classifier_pooling: str = "cls",
    sentence_transformers: str | None = None,
    normalize: bool = False,
) -> Path:
    """A 4-layer ModernBERT (hidden 32): layers 0 and 2 global, 1 and 3 local with a
    :data:`MODERNBERT_WINDOW` window."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_modernbert_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {name: tok.token_to_id(f"[{name.upper()}]") for name in ("pad", "cls", "sep")}
    config = ModernBertConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_LEN,
        global_attn_every_n_layers=2,
        local_attention=MODERNBERT_WINDOW,
        pad_token_id=ids["pad"],
        cls_token_id=ids["cls"],
        bos_token_id=ids["cls"],
        sep_token_id=ids["sep"],
        eos_token_id=ids["sep"],
        num_labels=num_labels,
        classifier_pooling=classifier_pooling,
        **{**_encoder_shape(), "num_hidden_layers": 4},
    )
    model_class = ModernBertForSequenceClassification if classifier else ModernBertModel
    _save_model(model_class, config, folder)
    if sentence_transformers is not None:
        write_sentence_transformers(folder, sentence_transformers, 32, normalize=normalize)
    return folder


def _qwen3_config(vocab_size: int, eos: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def make_qwen3_embedder(folder: Path) -> Path:
    """A Qwen3-Embedding-style model: a 2-layer ``Qwen3ForCausalLM`` whose tokenizer ends
    each input with ``<|endoftext|>``, in the sentence-transformers layout with last-token
    pooling and normalization (no chat template)."""
    from transformers import Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_qwen3_tokenizer(folder, append_eos=True)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|endoftext|>")
    _save_model(Qwen3ForCausalLM, _qwen3_config(vocab_size, eos), folder)
    prompts = {"query": "Instruct: Given a query, find the passages that answer it\nQuery:"}
    write_sentence_transformers(folder, "lasttoken", 64, normalize=True, prompts=prompts)
    return folder


def make_qwen3_reranker(folder: Path) -> Path:
    """A Qwen3-Reranker-style model: a 2-layer ``Qwen3ForCausalLM`` whose tokenizer has
    "yes" and "no" as single tokens (the reranker scores their logits)."""
    from transformers import Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_qwen3_tokenizer(folder, append_eos=False)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|endoftext|>")
    _save_model(Qwen3ForCausalLM, _qwen3_config(vocab_size, eos), folder)
    return folder


# -- the sentence-transformers layout -----------------------------------------------------

_POOLING_MODES = ("cls", "mean", "lasttoken")


def write_sentence_transformers(
    folder: Path,
    pooling: str,
    dimension: int,
    *,
    normalize: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> None:
    """Write the sentence-transformers files around the model saved in ``folder``."""
    assert pooling in _POOLING_MODES, pooling
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (folder / "2_Normalize").mkdir(exist_ok=True)
    _write_json(folder / "modules.json", modules)
    _write_json(
        folder / "sentence_bert_config.json", {"max_seq_length": MAX_LEN, "do_lower_case": False}
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    _write_json(folder / "1_Pooling" / "config.json", pooling_config(pooling, dimension))
    _write_json(
        folder / "config_sentence_transformers.json",
        {
            "__version__": {"sentence_transformers": "3.0.1", "transformers": "4.41.2"},
            "prompts": PROMPTS if prompts is None else prompts,
            "default_prompt_name": default_prompt_name,
            "similarity_fn_name": "cosine",
        },
    )


def pooling_config(pooling: str, dimension: int) -> dict[str, Any]:
    """``1_Pooling/config.json`` for one mode, with every ``pooling_mode_*`` key."""
    return {
        "word_embedding_dimension": dimension,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True,
    }


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
