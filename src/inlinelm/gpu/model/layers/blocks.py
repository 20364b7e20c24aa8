"""Block-quantized weights for a CPU's linear layers and embeddings: GGUF's ``Q8_0``,
``Q4_0`` and ``Q4_1``, 32 weights a block with float16 scales, kept as the file holds them.

A matmul rounds its input rows per block of 32 to 16 bits (two int8 planes on one float
scale) and takes each block's dot products in exact integer arithmetic (AVX-512 VNNI where
the CPU has it), so the weights are read at their stored size, 4.5 to 8.5 bits a weight
instead of float32's 32, and multiplied without widening them to floats. llama.cpp rounds
the inputs to 8 bits: on the default model (its Q4_1 file), teacher-forced on float32's
greedy answers to 32 prompts, 8 bits moved the top-1 token at 2.5% of positions, 16 bits at
none of 2,048 (``tests/gpu/model/test_blocks.py``); the second plane costs nothing where a
decode step reads weights from memory, and 1.5-1.7x the matmul time where many rows
compute (``benchmarks/quantized_cpu.py``).

There, from :data:`BF16_ROWS` rows (a prefill chunk) on a CPU with AMX, the weights are
widened to bfloat16 a group of rows at a time and multiplied by the input rounded to
bfloat16 with AMX's tile products, summed in float32 (``csrc/block_linear_amx.cpp``): 8
significant bits an input value rather than 16 a block, at 1.5-2x the integer loops' speed
for the default model's prefill, and teacher-forced quality per GGUF type level with
llama.cpp's (the README's performance section). Between :data:`AMX_ROWS` and
:data:`BF16_ROWS` rows (a decode step of many sequences) the integer loops' dot products are
taken by AMX's int8 tile products instead of VNNI's (``csrc/block_linear_amx_int8.cpp``):
the same bits, 1.2-1.4x faster.

The kernels and the tile layout are ``csrc/block_linear.cpp``, built at first use with the
project's other CPU kernels (:mod:`inlinelm.gpu.model.cpu_extension`); where they cannot be
built the layers stay float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inlinelm.gpu.model.cpu_extension import cpu_extension

BLOCK = 32
"""Weights per block (every kind): a quantized matrix's rows are a multiple of it long."""

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
"""The bytes of a block of each kind, GGUF's: float16 ``d`` (and ``m`` for Q4_1), then 32
int8 values or 16 bytes of 4-bit ones."""

KIND_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
"""Each kind's number in the extension (``csrc/block_linear.cpp``'s ``Kind``)."""
_TILE_ROWS = 16


def packed_bytes(kind: str, rows: int, cols: int) -> int:
    """The bytes of a [rows, cols] matrix of ``kind`` in the kernel's tiles: the blocks'
    own bytes, rows rounded up to a multiple of 16."""
    tiles = -(-rows // _TILE_ROWS)
    return tiles * _TILE_ROWS * (cols // BLOCK) * BLOCK_BYTES[kind]


def can_quantize(cols: int) -> bool:
    """Whether rows of ``cols`` weights split into blocks."""
    return cols > 0 and cols % BLOCK == 0


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A [rows, cols] weight matrix of one block kind, packed in the kernel's tiles (a flat
    uint8 tensor; :meth:`pack` fills it from GGUF blocks, row ranges at a time)."""

    kind: str
    rows: int
    cols: int
    data: torch.Tensor

    @classmethod
    def empty(cls, kind: str, rows: int, cols: int, device: torch.device) -> BlockWeight:
        """A zero matrix (every scale 0), to be filled by :meth:`pack`."""
        assert kind in BLOCK_BYTES and can_quantize(cols), (kind, cols)
        data = torch.zeros(packed_bytes(kind, rows, cols), dtype=torch.uint8, device=device)
        return cls(kind, rows, cols, data)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def pack(self, row0: int, blocks: torch.Tensor) -> None:
        """Rows ``[row0, row0 + len(blocks))`` from their GGUF blocks of this kind (uint8
        [n, cols / 32 * block bytes])."""
        _kernel().block_pack(
            self.data, KIND_IDS[self.kind], self.rows, self.cols, row0, blocks.contiguous()
        )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) as float32 [*ids.shape, cols]."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        rows: torch.Tensor = _kernel().block_rows(
            self.data, KIND_IDS[self.kind], self.rows, self.cols, flat
        )
        return rows.reshape(*ids.shape, self.cols)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 [rows, cols]."""
        return self.lookup(torch.arange(self.rows))

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, loops: str = "fastest"
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` [..., cols] of any float dtype (see the module's
        docstring for the two ways it computes). ``loops`` picks the kernel's
        implementation: ``"fastest"`` (bfloat16 products from :data:`BF16_ROWS` rows where
        :func:`bf16_ready`, AMX's int8 tile products from :data:`AMX_ROWS` where
        :func:`amx_ready`, else the integer loops), ``"integer"`` (the fastest integer
        loops: AVX-512 VNNI where the CPU has it, else AVX2, else plain C++), ``"amx"``,
        ``"avx2"`` and ``"plain"`` (the integer loops' other implementations, which give
        the same bits; ``"amx"`` where :func:`amx_ready`), ``"bfloat16"`` (the bfloat16
        products at any rows, where :func:`bf16_ready`)."""
        flat = x.reshape(-1, self.cols)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y: torch.Tensor = _kernel().block_linear(
            flat, self.data, KIND_IDS[self.kind], self.rows, self.cols, bias, _LOOPS[loops]
        )
        y = y.reshape(*x.shape[:-1], self.rows)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


_LOOPS = {"fastest": 0, "avx2": 1, "plain": 2, "integer": 3, "bfloat16": 4, "amx": 5}
"""csrc/block_linear.cpp's ``Loops``."""

BF16_ROWS = 64
"""From this many rows ``"fastest"`` takes the bfloat16 products where it can
(``csrc/block_linear.cpp``'s ``kBf16Rows``)."""

AMX_ROWS = 16
"""From this many rows (below :data:`BF16_ROWS`) ``"fastest"`` takes AMX's int8 tile
products where it can (``kAmxRows``): a tile multiply takes 16 rows."""


def fastest_loops() -> str:
    """The integer loops the kernel runs here: ``"vnni"``, ``"avx2"`` or ``"plain"``."""
    loops: str = _kernel().block_loops()
    return loops


def bf16_ready() -> bool:
    """Whether the kernel takes bfloat16 products on this CPU's AMX for many rows
    (``csrc/block_linear_amx.cpp``)."""
    ready: bool = _kernel().block_bf16_ready()
    return ready


def amx_ready() -> bool:
    """Whether the kernel takes the integer loops' dot products on this CPU's AMX
    (``csrc/block_linear_amx_int8.cpp``)."""
    ready: bool = _kernel().block_amx_ready()
    return ready


def _kernel() -> Any:
    kernel = cpu_extension()
    assert kernel is not None, "block weights only where the kernel built"
    return kernel


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [rows, cols] as Q8_0 blocks (uint8 [rows, cols / 32 * 34]), to the bit as
    llama.cpp quantizes: per block ``d = amax / 127``, ``q = round(w / d)`` (halves away
    from zero), ``d`` stored as float16 (an all-zero block: ``d = 0``)."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    d = w.abs().amax(dim=-1, keepdim=True) / torch.tensor(127.0)
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    v = (w * inv).abs()
    whole = torch.floor(v)
    q = (torch.sign(w) * (whole + torch.floor(2 * (v - whole)))).to(torch.int8)
    blocks = torch.cat((d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)), dim=-1)
    return blocks.reshape(rows, -1)


def dequantize_blocks(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF blocks of ``kind`` (uint8 [rows, cols / 32 * block bytes]) as float32 [rows,
    cols] (no kernel needed: a loader's float destination, the tests' reference)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCK_BYTES[kind])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, -1)
    qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    if kind == "Q4_0":
        return (d * (q - 8)).reshape(rows, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows, -1)
