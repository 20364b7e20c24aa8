"""What one scheduler step may still take: tokens (``max_num_batched_tokens``) and
sequences (``max_num_seqs``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepBudget:
    """What is left of one step's token budget and sequence cap."""

    num_tokens: int
    num_seqs: int

    @property
    def exhausted(self) -> bool:
        return self.num_tokens <= 0 or self.num_seqs <= 0

    def take(self, num_tokens: int) -> None:
        self.num_tokens -= num_tokens
        self.num_seqs -= 1
