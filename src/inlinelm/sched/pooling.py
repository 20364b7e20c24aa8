"""What a pooling request returns instead of tokens: plain data the runner reads.

A pooling request (an embedding, a classifier's or a reranker's score) is a prompt computed
once and never sampled: the step that computes its last prompt token returns the request's
vector, and the scheduler finishes it there. It is batched with the other requests of a
step, and a decoder computes its prompt in chunks like any prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingMethod = Literal["last", "mean", "cls"]
PoolingHead = Literal["embed", "classify", "token_pair"]


@dataclass(frozen=True, slots=True)
class Pooling:
    """How a request's hidden states become its result.

    ``head``: ``"embed"`` pools the last hidden states by ``method`` (the last token's,
    their mean, or the first token's), keeps the first ``dimensions`` values (Matryoshka
    truncation) and L2-normalises when ``normalize``; ``"classify"`` runs the model's
    sequence-classification head (a sigmoid over one label, a softmax over several, when
    ``activation``); ``"token_pair"`` scores the last token's logits of
    ``token_pair = (yes id, no id)`` as ``sigmoid(logit(yes) - logit(no))`` (a decoder
    reranker's answer). ``token_type_ids``: the segment of each prompt token for an
    encoder that reads them (a cross-encoder's query/document pair).
    """

    head: PoolingHead = "embed"
    method: PoolingMethod = "last"
    normalize: bool = True
    dimensions: int | None = None
    activation: bool = True
    token_type_ids: tuple[int, ...] | None = None
    token_pair: tuple[int, int] | None = None

    @property
    def needs_every_position(self) -> bool:
        """Whether the result reads hidden states before the last token (a prefix served
        from the cache would leave them uncomputed)."""
        return self.head != "token_pair" and (self.head == "classify" or self.method != "last")
