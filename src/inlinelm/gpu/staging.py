"""One step's host data on its way to the device, in one copy.

Everything the host knows about a step (token ids, positions, slots, page tables, sampling
settings, penalty and ban indices) is added to a :class:`HostStaging` as numpy columns,
packed into one host buffer (pinned on CUDA), sent with one non-blocking copy, and read back
as views on both sides. ``torch.tensor(values, device=cuda)`` and indexing a device tensor
with a host list each do a *blocking* copy that waits for the step in flight, which the
pipelined loop cannot afford.

:func:`copy_to_device` is the only host-to-device copy of the step path (tests count its
calls); pinning is the only device-only call here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

_ALIGN = 16
"""Bytes each column's offset is a multiple of (any dtype's view of the buffer is legal)."""

_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: one non-blocking copy (none on the CPU)."""
    return host.to(device, non_blocking=True)


class StagedColumn:
    """A handle on one column of a :class:`HostStaging`; its tensors exist once it is sent."""

    __slots__ = ("_index", "_staging")

    def __init__(self, staging: HostStaging, index: int) -> None:
        self._staging = staging
        self._index = index

    def get(self) -> torch.Tensor:
        """The column on the device (a view of the one copy)."""
        return self._staging.view(self._index, on_device=True)

    def host(self) -> torch.Tensor:
        """The column in the host buffer (pinned on CUDA)."""
        return self._staging.view(self._index, on_device=False)


class HostStaging:
    """Columns added on the host, then :meth:`send` copies them all to ``device`` at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._arrays: list[npt.NDArray[np.generic]] = []
        self._offsets: list[int] = []
        self._num_bytes = 0
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        # Each buffer viewed as each dtype read from it, so a column is one slice of it.
        self._typed: dict[tuple[bool, np.dtype[np.generic]], torch.Tensor] = {}

    def add(
        self, values: npt.ArrayLike | Sequence[object], dtype: type[np.generic]
    ) -> StagedColumn:
        """Stage ``values`` (any shape) as ``dtype``; read it through the handle after sending."""
        assert self._host is None, "staged after send"
        array = np.ascontiguousarray(values, dtype=dtype)
        self._arrays.append(array)
        self._offsets.append(self._num_bytes)
        self._num_bytes += -(-array.nbytes // _ALIGN) * _ALIGN
        return StagedColumn(self, len(self._arrays) - 1)

    def send(self) -> None:
        """Pack every column into one host buffer and start its one copy to the device.

        NOTE: the pinned buffer comes from torch's caching host allocator, which reuses a
        block only once the copies reading it have finished, so it may be dropped at once.
        """
        host = torch.empty(
            max(self._num_bytes, _ALIGN), dtype=torch.uint8, pin_memory=self.device.type == "cuda"
        )
        flat = host.numpy()
        for array, offset in zip(self._arrays, self._offsets, strict=True):
            flat[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)[...] = array
        self._host = host
        self._device = copy_to_device(host, self.device)

    def view(self, index: int, *, on_device: bool) -> torch.Tensor:
        """Column ``index`` as a tensor of its dtype and shape, in one of the two buffers.

        NOTE: a slice of the buffer's view as the column's dtype (made once per dtype), so a
        flat column costs one torch op, not three: this runs for every column every step.
        """
        array, offset = self._arrays[index], self._offsets[index]
        typed = self._typed.get((on_device, array.dtype))
        if typed is None:
            buffer = self._device if on_device else self._host
            assert buffer is not None, "read before send"
            typed = self._typed[on_device, array.dtype] = buffer.view(_TORCH_DTYPES[array.dtype])
        start = offset // array.itemsize
        column = typed[start : start + array.size]
        return column if array.ndim == 1 else column.view(array.shape)


def send_one(values: npt.ArrayLike, dtype: type[np.generic], device: torch.device) -> torch.Tensor:
    """One column on its own (outside the step path: warm-up, profiling, tests)."""
    staging = HostStaging(device)
    column = staging.add(values, dtype)
    staging.send()
    return column.get()
