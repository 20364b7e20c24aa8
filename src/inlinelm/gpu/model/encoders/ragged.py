"""The ragged layout of an encoder batch: sequences concatenated row after row, no padding.

Every per-token op (embeddings, linears, norms, MLPs) runs on the ``[T, ...]`` rows as they
are; only attention needs each sequence as a block. :class:`RaggedBatch` orders the
sequences longest first and cuts them into :class:`AttentionGroup` runs of similar
length, each padded to its own longest for one attention call: a batch of mixed lengths
pads little (at most :data:`MAX_PADDING` of a group's tokens), and a group's rows are one
contiguous slice of the sorted layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PADDING = 0.25
"""The most padding a group may add, as a fraction of its tokens (attention's work and
the padded buffer grow with it; each group costs one more attention call)."""

MIN_GROUP_TOKENS = 256
"""A group closes only once it holds this many tokens: a few short sequences cost less
padded into the group before them than in a call of their own."""


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences ``rows`` of the sorted layout attended as one ``[num_seqs, max_len]`` block.

    ``slots[t]`` is the group's row ``t`` in the block flattened to ``num_seqs *
    max_len`` rows, and ``key_mask`` (``[num_seqs, 1, 1, max_len]``, True for a real
    token) hides the padding; both are None when the group's sequences have one length
    (the block is then a view of the rows).
    """

    start: int
    stop: int
    num_seqs: int
    max_len: int
    slots: torch.Tensor | None
    key_mask: torch.Tensor | None

    @classmethod
    def of(
        cls, start: int, seq_lens: list[int], positions: torch.Tensor, device: torch.device
    ) -> AttentionGroup:
        """The group of sequences of ``seq_lens`` (longest first) from row ``start``;
        ``positions`` are the sorted layout's."""
        num_rows, max_len = sum(seq_lens), seq_lens[0]
        if seq_lens[-1] == max_len:
            return cls(start, start + num_rows, len(seq_lens), max_len, None, None)
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        seq_ids = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=device), lens, output_size=num_rows
        )
        slots = seq_ids * max_len + positions[start : start + num_rows]
        key_mask = (torch.arange(max_len, device=device) < lens[:, None])[:, None, None]
        return cls(start, start + num_rows, len(seq_lens), max_len, slots, key_mask)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """The group's ``[num_rows, ...]`` rows as ``[num_seqs, max_len, ...]``, zeros in
        the padding."""
        shape = (self.num_seqs, self.max_len, *rows.shape[1:])
        if self.slots is None:
            return rows.view(shape)
        # NOTE: zeros, not empty: a NaN in a masked key's row would still reach the softmax.
        padded = rows.new_zeros((self.num_seqs * self.max_len, *rows.shape[1:]))
        padded.index_copy_(0, self.slots, rows)
        return padded.view(shape)

    def unpad(self, padded: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`pad`: ``[num_seqs, max_len, ...]`` back to the rows,
        written into ``out`` (contiguous) when given."""
        flat = padded.reshape(self.num_seqs * self.max_len, *padded.shape[2:])
        if out is None:
            return flat if self.slots is None else flat.index_select(0, self.slots)
        if self.slots is None:
            return out.copy_(flat)
        return torch.index_select(flat, 0, self.slots, out=out)

    def attention_mask(self, half_window: int | None) -> torch.Tensor | None:
        """The boolean mask (True: may attend) of the block: the key padding, and for
        ``half_window`` also ``|query - key| <= half_window``. None when nothing is
        hidden (SDPA then takes its unmasked path)."""
        if half_window is None or half_window >= self.max_len - 1:
            return self.key_mask
        device = None if self.key_mask is None else self.key_mask.device
        index = torch.arange(self.max_len, device=device)
        window = (index[:, None] - index[None, :]).abs() <= half_window
        return window if self.key_mask is None else window & self.key_mask


@dataclass(frozen=True, slots=True)
class RaggedBatch:
    """The sorted layout of a ragged batch: its sequences longest first (ties in the given
    order), their rows one after another.

    ``order[t]`` is the given layout's row that the sorted layout's row ``t`` holds (None
    when the given order is sorted already); ``positions[t]`` is row ``t``'s index in its
    own sequence; ``groups`` cover the rows in order.
    """

    seq_lens: tuple[int, ...]
    max_len: int
    order: torch.Tensor | None
    positions: torch.Tensor
    groups: tuple[AttentionGroup, ...]

    @classmethod
    def of(cls, seq_lens: list[int] | tuple[int, ...], device: torch.device) -> RaggedBatch:
        """The layout of sequences of ``seq_lens`` tokens (each at least 1) on ``device``."""
        assert seq_lens and min(seq_lens) > 0, seq_lens
        by_length = sorted(range(len(seq_lens)), key=lambda j: -seq_lens[j])
        sorted_lens = [seq_lens[j] for j in by_length]
        num_tokens = sum(seq_lens)
        lens = torch.tensor(sorted_lens, dtype=torch.int64, device=device)
        firsts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=num_tokens)
        positions = torch.arange(num_tokens, device=device) - firsts
        order = None
        if sorted_lens != list(seq_lens):
            given = torch.tensor(seq_lens, dtype=torch.int64, device=device)
            given_starts = (torch.cumsum(given, 0) - given)[torch.tensor(by_length, device=device)]
            order = torch.repeat_interleave(given_starts, lens, output_size=num_tokens) + positions
        groups = _groups(sorted_lens, positions, device)
        return cls(tuple(seq_lens), sorted_lens[0], order, positions, groups)

    def attention_masks(self, half_window: int | None) -> tuple[torch.Tensor | None, ...]:
        """Each group's :meth:`AttentionGroup.attention_mask`."""
        return tuple(group.attention_mask(half_window) for group in self.groups)

    def sort(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the given layout in the sorted one."""
        return rows if self.order is None else rows.index_select(0, self.order)

    def unsort(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the sorted layout back in the given one."""
        if self.order is None:
            return rows
        return torch.empty_like(rows).index_copy_(0, self.order, rows)


def _groups(
    sorted_lens: list[int], positions: torch.Tensor, device: torch.device
) -> tuple[AttentionGroup, ...]:
    """Cut sequences of ``sorted_lens`` (longest first) into groups, each as many as fit
    within :data:`MAX_PADDING` once it holds :data:`MIN_GROUP_TOKENS`."""
    groups: list[AttentionGroup] = []
    first = start = tokens = 0  # the open group's first sequence, first row, tokens
    for i, length in enumerate(sorted_lens):
        padded = (i - first + 1) * sorted_lens[first]
        if tokens >= MIN_GROUP_TOKENS and padded > (1 + MAX_PADDING) * (tokens + length):
            groups.append(AttentionGroup.of(start, sorted_lens[first:i], positions, device))
            first, start, tokens = i, start + tokens, 0
        tokens += length
    groups.append(AttentionGroup.of(start, sorted_lens[first:], positions, device))
    return tuple(groups)
