"""Token bitmasks for the rows of a step that follow a grammar (structured output).

Before sampling, each constrained row's matcher writes its allowed-token bits into a host
buffer (llguidance, many rows in parallel on its own threads with the GIL released); the
buffer is copied to the device and the disallowed logits set to ``-inf``. A step with no
constrained row calls nothing here and allocates nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from inlinelm.gpu.staging import copy_to_device
from inlinelm.structured.matcher import GrammarMatcher

_BITS = 32


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set ``logits[i, t] = -inf`` where bit ``t`` of row ``i`` of ``mask`` is clear.

    ``mask`` is ``[rows, words]`` int32 on the logits' device (bit ``t % 32`` of word
    ``t // 32``); tokens past ``32 * words`` are disallowed.
    """
    rows, words = mask.shape
    width = words * _BITS
    vocab = logits.shape[1]
    if vocab > width:
        logits[:, width:] = float("-inf")
        logits = logits[:, :width]
    shifts = torch.arange(_BITS, device=mask.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(rows, width)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class GrammarMasks:
    """Fills and applies the bitmasks of one runner's constrained rows.

    Two pinned host buffers alternate: on CUDA the copy of step N's mask may still be
    pending when step N+1 fills its own, but step N is collected (its copy done) before
    step N+2 reuses the buffer.
    """

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self._executor: Any = None

    def apply(
        self, logits: torch.Tensor, matchers: list[GrammarMatcher], rows: torch.Tensor | None
    ) -> None:
        """Mask the rows ``rows`` (on the device; None: every row, in order) of ``logits``
        with the next-token mask of the matchers, one matcher per row."""
        words = -(-matchers[0].vocab_size // _BITS)
        host = self._next_buffer(words)[: len(matchers)]
        self._fill(host, matchers)
        mask = copy_to_device(host, self.device)
        if rows is None:
            assert len(matchers) == logits.shape[0]
            apply_token_bitmask(logits, mask)
            return
        index = rows
        selected = logits.index_select(0, index)
        apply_token_bitmask(selected, mask)
        logits.index_copy_(0, index, selected)

    def _fill(self, host: torch.Tensor, matchers: list[GrammarMatcher]) -> None:
        row_bytes = host.shape[1] * host.element_size()
        if len(matchers) == 1:
            matchers[0].ll_matcher.unsafe_compute_mask_ptr(host.data_ptr(), row_bytes)
            return
        self._executor_for().unsafe_compute_mask_ptr(
            [(m.ll_matcher, i) for i, m in enumerate(matchers)],
            host.data_ptr(),
            row_bytes,
            len(matchers),
        )

    def _executor_for(self) -> Any:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def _next_buffer(self, words: int) -> torch.Tensor:
        if not self._buffers or self._buffers[0].shape[1] != words:
            pin = self.device.type == "cuda"
            self._buffers = [
                torch.empty((self.max_rows, words), dtype=torch.int32, pin_memory=pin)
                for _ in range(2)
            ]
        self._turn ^= 1
        return self._buffers[self._turn]
