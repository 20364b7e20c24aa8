"""What every encoder model is: ragged token rows in, last hidden states out, and the
sequence-classification head of a ``*ForSequenceClassification`` checkpoint.

Each family (:mod:`.bert`, :mod:`.modernbert`) subclasses :class:`EncoderModel` and says,
in :meth:`EncoderModel.checkpoint_targets`, which checkpoint tensor fills which of its
parameters; :mod:`.loading` reads them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from inlinelm.gpu.model.encoders.config import EncoderConfig
from inlinelm.gpu.model.encoders.linear import EncoderLinear
from inlinelm.gpu.model.encoders.ragged import RaggedBatch


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, and a row range of it for one of the
    pieces of a fused parameter (queries, keys, values)."""

    param: str
    rows: tuple[int, int] | None = None


class EncoderModel(nn.Module, ABC):
    """A bidirectional encoder over ragged batches (no padding between sequences)."""

    config: EncoderConfig

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, seq_lens: list[int]
    ) -> torch.Tensor:
        """The last hidden state of each token.

        ``input_ids``: ``[T]`` int64, the tokens of ``len(seq_lens)`` sequences one after
        the other (each 1 to ``config.max_model_len`` tokens); ``token_type_ids``: ``[T]``
        or None (all 0; a model with one token type ignores them). Returns ``[T, hidden]``
        in the model's dtype, row ``i`` of sequence ``j`` equal to transformers'
        ``last_hidden_state[j, i]`` for that sequence run alone. Raises ``ValueError``
        for lengths that do not add up to ``T`` or that the model cannot take.
        """
        check_lengths(input_ids, seq_lens, self.config.max_model_len)
        if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
            raise ValueError(
                f"token_type_ids has shape {tuple(token_type_ids.shape)}, "
                f"input_ids {tuple(input_ids.shape)}"
            )
        return self.encode(input_ids, token_type_ids, RaggedBatch.of(seq_lens, input_ids.device))

    def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """``[len(seq_lens), num_labels]`` float32 logits from :meth:`forward`'s output,
        equal to transformers' ``*ForSequenceClassification`` logits. Raises
        ``ValueError`` when the checkpoint has no classifier."""
        if not self.config.classifier:
            raise ValueError(
                f"this {self.config.model_type} checkpoint has no sequence-classification head "
                "(its config.json architectures name no *ForSequenceClassification)"
            )
        if sum(seq_lens) != hidden.shape[0] or min(seq_lens, default=0) < 1:
            raise ValueError(_split_error(seq_lens, hidden.shape[0]))
        return self.score(hidden, seq_lens).float()

    @abstractmethod
    def encode(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, batch: RaggedBatch
    ) -> torch.Tensor:
        """:meth:`forward` on checked inputs: ``input_ids`` and ``token_type_ids`` in the
        given layout, the result too (:meth:`RaggedBatch.sort` and ``unsort`` move rows
        between it and the sorted one the layers run in)."""

    @abstractmethod
    def score(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """:meth:`classify` on checked inputs of a classifier checkpoint."""

    @abstractmethod
    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint tensor this model needs, by its Hugging Face name without the
        base model's prefix (``bert.``, ``roberta.``, ``model.``), and where it goes."""


def first_rows(hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """``[B, hidden]``: each sequence's first row (its CLS token)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    return hidden.index_select(0, torch.cumsum(lens, 0) - lens)


def mean_rows(hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """``[B, hidden]``: the mean of each sequence's rows."""
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    seq_ids = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=hidden.device), lens, output_size=hidden.shape[0]
    )
    sums = hidden.new_zeros(len(seq_lens), hidden.shape[1]).index_add_(0, seq_ids, hidden)
    return sums / lens.to(hidden.dtype)[:, None]


def check_lengths(input_ids: torch.Tensor, seq_lens: list[int], max_len: int) -> None:
    """Raise ``ValueError`` unless ``seq_lens`` split the 1-D ``input_ids`` into sequences
    of 1 to ``max_len`` tokens."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D (ragged rows), not {tuple(input_ids.shape)}")
    if not seq_lens or sum(seq_lens) != input_ids.shape[0] or min(seq_lens) < 1:
        raise ValueError(_split_error(seq_lens, input_ids.shape[0]))
    if max(seq_lens) > max_len:
        raise ValueError(f"a sequence of {max(seq_lens)} tokens is past the model's {max_len}")


def _split_error(seq_lens: list[int], num_rows: int) -> str:
    return (
        f"seq_lens ({len(seq_lens)} sequences, {sum(seq_lens)} tokens, shortest "
        f"{min(seq_lens, default=0)}) do not split {num_rows} rows into sequences of 1 or more"
    )


def module_targets(source: str, dest: str, module: nn.Module) -> dict[str, WeightTarget]:
    """The targets of a module's own parameters (``weight``, and ``bias`` when it has
    one): checkpoint ``{source}.{name}`` fills ``{dest}.{name}``."""
    return {
        f"{source}.{name}": WeightTarget(f"{dest}.{name}")
        for name, _ in module.named_parameters(recurse=False)
    }


def fused_targets(
    sources: tuple[str, ...], dest: str, module: EncoderLinear
) -> dict[str, WeightTarget]:
    """The targets of a linear layer fused from ``sources``, equal row blocks in order."""
    rows = module.out_features // len(sources)
    return {
        f"{source}.{name}": WeightTarget(f"{dest}.{name}", (i * rows, (i + 1) * rows))
        for i, source in enumerate(sources)
        for name, _ in module.named_parameters(recurse=False)
    }
