"""A step's plan for the pure-torch attention backend (:mod:`.torch_backend`): which rows
attend together. ``TorchAttention.prepare`` makes one per step, once for all layers: decode
rows in groups of one batched SDPA call each (or one group of every row, which the CPU
extension's paged decode attends whole), and each prefill chunk on its own."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one query token: one batched SDPA call, keys masked past each length."""

    token_index: torch.Tensor  # [Bd] rows of the flat batch
    block_tables: torch.Tensor  # [Bd, nb]
    key_mask: torch.Tensor | None  # [Bd, 1, 1, nb * block_size] bool, None when all full
    seq_lens: torch.Tensor  # [Bd] context lengths (device)
    serial: bool = False  # attend on one intra-op thread (torch_backend.SERIAL_DECODE_MAX_KEYS)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask

    def mask(self, window: int | None, num_keys: int) -> torch.Tensor | None:
        """The key mask of a layer that sees ``window`` keys (None: all), made once per step."""
        if window is None:
            return self.key_mask
        if window not in self.windows:
            positions = torch.arange(num_keys, device=self.seq_lens.device).view(1, -1)
            lens = self.seq_lens.view(-1, 1)
            visible = (positions < lens) & (positions >= lens - window)
            self.windows[window] = visible.view(len(self.seq_lens), 1, 1, -1)
        return self.windows[window]


@dataclass(slots=True)
class Chunk:
    """One prefill chunk: its own SDPA call, causal against its cached prefix."""

    start: int
    end: int
    seq_len: int
    block_table: torch.Tensor  # [nb]
    mask: torch.Tensor | None  # [q, seq_len] bool; None means plain causal (no prefix)
    windows: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def explicit_mask(self, window: int | None) -> torch.Tensor:
        """The [q, seq_len] mask of a layer that sees ``window`` keys (None: all, causal),
        made once per step."""
        if window not in self.windows:
            query_len = self.end - self.start
            device = self.block_table.device
            q_pos = torch.arange(self.seq_len - query_len, self.seq_len, device=device).view(-1, 1)
            k_pos = torch.arange(self.seq_len, device=device).view(1, -1)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            self.windows[window] = visible
        return self.windows[window]


@dataclass(slots=True)
class Plan:
    """A step's decode groups and prefill chunks, over pages of ``block_size`` slots."""

    block_size: int
    decode: list[DecodeGroup]
    chunks: list[Chunk]
    # One decode group holding every token of the step in order: its result is the output.
    whole: bool = False
