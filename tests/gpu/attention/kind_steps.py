"""Layer kinds through the FlashInfer backend beside the torch backend, on given steps.

Eager: one ``prepare`` for the step, then a layer per kind. Graphed: the metadata made
once (as at a capture), then, before each replay, every kind of the size planned. On CUDA
the graphed step is a captured CUDA graph; elsewhere it runs eagerly through the same
static buffers. Each result pairs FlashInfer's output with the torch backend's on the
step in float32. The gpu tests assert on them; the GPU check's attention stage
(``benchmarks/gpu_stages.py``) records their errors, on the CPU through the stand-in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from inlinelm.gpu.attention.metadata import LayerAttention
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.staging import HostStaging
from tests.gpu.paged_steps import Step, run_backend

Result = tuple[LayerAttention, torch.Tensor, torch.Tensor]
"""A layer's kind, FlashInfer's output, and the torch backend's in float32."""


def float32(step: Step) -> Step:
    """``step`` with its q/k/v and cache in float32: the reference's inputs."""
    return dataclasses.replace(
        step, q=step.q.float(), k=step.k.float(), v=step.v.float(), kv_cache=step.kv_cache.float()
    )


def reference(backend: Any, step: Step, block_size: int, kind: LayerAttention) -> torch.Tensor:
    """The torch backend's output for one layer of ``kind`` on ``step``, in float32."""
    torch_attention = TorchAttention(backend.num_heads, backend.num_kv_heads, backend.head_dim)
    out, _ = run_backend(torch_attention, float32(step), block_size, layer=kind)
    return out


def eager_results(
    backend: Any, layers: Sequence[LayerAttention], steps: Sequence[Step], block_size: int
) -> list[Result]:
    """Layer ``i`` of kind ``layers[i]`` on the data of ``steps[i]`` (one page table), all
    on one ``prepare``."""
    meta = steps[0].metadata(steps[0].q.device)
    backend.prepare(meta, block_size)
    results = []
    for step, kind in zip(steps, layers, strict=True):
        cache = step.kv_cache.clone()
        out = backend.forward(step.q, step.k, step.v, cache, meta, kind)
        results.append((kind, out, reference(backend, step, block_size, kind)))
    return results


def graph_results(
    backend: Any,
    attention: Any,
    kinds: Sequence[LayerAttention],
    steps: Sequence[Step],
    *,
    capture: bool,
) -> list[Result]:
    """Decode ``steps`` (all of one row count, a size ``attention`` was initialised with)
    through ``attention``'s static buffers, every kind a layer; with ``capture``, as one
    CUDA graph captured once and replayed for each step."""
    block_size = attention.block_size
    static = StaticDecode(max(s.kv_cache.shape[1] for s in steps), steps[0])
    meta = attention.prepare_for_capture(len(steps[0].seq_lens), static.slots)
    outs: dict[LayerAttention, torch.Tensor] = {}

    def layers() -> None:
        for kind in kinds:
            outs[kind] = backend.forward(static.q, static.k, static.v, static.cache, meta, kind)

    static.load(steps[0])
    plan_graph_step(attention, steps[0])
    replay = _captured(layers) if capture else layers
    results = []
    for step in steps:
        static.load(step)
        plan_graph_step(attention, step)
        replay()
        results += [(k, outs[k].clone(), reference(backend, step, block_size, k)) for k in kinds]
    return results


def _captured(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` warmed up on a side stream, then captured: its graph's replay."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch stub
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def plan_graph_step(attention: Any, step: Step) -> None:
    """What DecodeGraphs does before a replay: stage the rows, send, run the plan."""
    staging = HostStaging(step.q.device)
    size = len(step.seq_lens)
    plan = attention.prepare_for_replay(size, step.seq_lens, step.block_tables, staging)
    staging.send()
    plan()


class StaticDecode:
    """A graphed step's static inputs: q/k/v, the slots and a cache of ``slots`` slots,
    refilled from each step before its replay."""

    def __init__(self, slots: int, like: Step) -> None:
        device = like.q.device
        self.q, self.k, self.v = (torch.empty_like(t) for t in (like.q, like.k, like.v))
        self.slots = torch.zeros(len(like.q), dtype=torch.int64, device=device)
        shape = (2, slots, *like.kv_cache.shape[2:])
        self.cache = torch.zeros(shape, dtype=like.kv_cache.dtype, device=device)

    def load(self, step: Step) -> None:
        for static, data in ((self.q, step.q), (self.k, step.k), (self.v, step.v)):
            static.copy_(data)
        self.slots.copy_(torch.from_numpy(step.slot_mapping))
        self.cache.zero_()
        self.cache[:, : step.kv_cache.shape[1]].copy_(step.kv_cache)
