"""Pooling: a request's hidden states made into its result (engine thread).

Shared by the decoder runner (a decoder embedder's last token, a decoder reranker's two
answer logits) and the encoder runner (CLS, mean or last-token pooling, a
cross-encoder's classifier). Rows are ragged: the tokens of several sequences one after
another, ``seq_lens`` long each; nothing is padded.
"""

from __future__ import annotations

import torch

from inlinelm.sched.pooling import Pooling, PoolingMethod


def pool_rows(
    hidden: torch.Tensor, seq_lens: list[int], methods: list[PoolingMethod]
) -> torch.Tensor:
    """One row per sequence ``[len(seq_lens), hidden]``: its last token's, first token's
    or its tokens' mean hidden state (``methods[i]`` for sequence ``i``)."""
    lengths = torch.tensor(seq_lens, device=hidden.device)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    pooled = hidden[ends - 1]
    means = [i for i, m in enumerate(methods) if m == "mean"]
    if means:
        segment = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=hidden.device), lengths
        )
        sums = torch.zeros(
            len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device
        )
        sums.index_add_(0, segment, hidden.float())
        rows = torch.tensor(means, device=hidden.device)
        pooled = pooled.clone()
        pooled[rows] = (sums[rows] / lengths[rows, None]).to(hidden.dtype)
    firsts = [i for i, m in enumerate(methods) if m == "cls"]
    if firsts:
        rows = torch.tensor(firsts, device=hidden.device)
        pooled = pooled.clone()
        pooled[rows] = hidden[starts[rows]]
    return pooled


def embeddings(pooled: torch.Tensor, poolings: list[Pooling]) -> list[list[float]]:
    """Each pooled row cut to its request's ``dimensions`` (Matryoshka) and L2-normalised
    when it asks, as float32 lists on the host."""
    rows = pooled.float()
    out = []
    for row, pooling in zip(rows, poolings, strict=True):
        if pooling.dimensions is not None:
            row = row[: pooling.dimensions]
        if pooling.normalize:
            row = torch.nn.functional.normalize(row, dim=0)
        out.append(row)
    return [row.tolist() for row in out]


def class_scores(logits: torch.Tensor, poolings: list[Pooling]) -> list[list[float]]:
    """A classifier's logits ``[rows, labels]`` as scores: a sigmoid over one label, a
    softmax over several, for the requests whose ``activation`` is on; raw otherwise."""
    logits = logits.float()
    activated = torch.sigmoid(logits) if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)
    return [
        (activated[i] if pooling.activation else logits[i]).tolist()
        for i, pooling in enumerate(poolings)
    ]


def token_pair_scores(logits: torch.Tensor, poolings: list[Pooling]) -> list[list[float]]:
    """A decoder reranker's score from its last-token logits ``[rows, V]``:
    ``sigmoid(logit(yes) - logit(no))``, the probability of "yes" between the two."""
    out = []
    for row, pooling in zip(logits.float(), poolings, strict=True):
        assert pooling.token_pair is not None, "a token-pair pooling names its tokens"
        yes, no = pooling.token_pair
        margin = row[yes] - row[no]
        out.append([float(torch.sigmoid(margin)) if pooling.activation else float(margin)])
    return out
