"""KV-cache sizing and allocation: how many blocks the cache holds, and the tensors.

``num_kv_blocks`` or ``kv_cache_bytes``, when set, decide on any device. Otherwise a CPU
cache holds ``max_num_seqs`` sequences of a typical length (:func:`cpu_kv_cache_bytes`),
and a CUDA cache takes what is left of ``gpu_memory_utilization`` x the memory free when
the engine started, once the weights, the peak activations of a profiling forward and the
CUDA-graph reserve are counted. :func:`gpu_kv_cache_bytes` is that arithmetic on plain
numbers; :func:`profile_gpu_memory` takes the measurements it needs (the weights' share
of the device, the peak of a profiling forward and sampling), and
:func:`free_device_memory` and :func:`peak_memory_of` are the only CUDA calls here. Every
spec says why it has its size (``reason``, logged once).

A CPU cache is an anonymous private mapping: the kernel hands out zero pages and counts a
page in the process's memory only once the cache writes it, so the cache's memory grows
as sequences fill it (up to its size), and returns to the system when it is freed.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.sampling.metadata import SamplingMetadata
from inlinelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TYPICAL_SEQUENCE_TOKENS = 2048
"""The length a CPU cache is sized for per sequence by default (when ``max_model_len`` is
longer): a chat turn with some history, and its answer. A longer sequence still runs: it
takes blocks the others would have had, the cache always holds one ``max_model_len``
sequence, and the scheduler preempts a sequence when no block is left."""


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """How many blocks the cache holds, what one block costs, and why it has that size."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HostMemory:
    """What a CPU cache's default size is bounded by, in bytes."""

    weights: int  # the model's weights in its dtype
    left: int | None  # host memory available besides the model's other parts; None: unknown


@dataclass(frozen=True, slots=True)
class GpuMemoryUse:
    """What the runner measured on its CUDA device before allocating the cache, in bytes."""

    free_at_start: int  # free device memory before the runner allocated anything
    used: int  # held once loaded and profiled: weights, workspaces, CUDA library state
    peak_activations: int  # the profiling forward's peak above what was allocated before it


DummyForward = Callable[[int, int, list[torch.Tensor]], torch.Tensor]
"""``forward(n, num_logits, kv_caches)``: the runner's forward over one sequence of ``n``
zero tokens whose cache is the first blocks of ``kv_caches``; logits of its last
``num_logits`` positions."""

Sample = Callable[[torch.Tensor, SamplingMetadata], object]
"""The runner's sampler: ``sample(logits, meta)``."""


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in every layer: 2 x layers x KV heads x head dim x
    the dtype's size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of ``block_size`` tokens in every layer."""
    return block_size * bytes_per_token(cfg, dtype)


def cpu_kv_cache_bytes(
    per_token: int, *, max_num_seqs: int, max_model_len: int, block_size: int, host: HostMemory
) -> tuple[int, str]:
    """The default CPU budget and why: ``max_num_seqs`` sequences of
    ``min(max_model_len, TYPICAL_SEQUENCE_TOKENS)`` tokens, at most the weights' size and
    half the host memory left, at least one ``max_model_len`` sequence.

    The weights bound it because a CPU decode step is bound by memory reads: it reads every
    weight once and the cache of every running sequence, so with as much live cache as
    weights a step already takes twice the weights-only time; a larger cache fills only
    with batches whose steps attention dominates. Half the memory left keeps room for
    activations and everything else in the process.
    """
    length = min(max_model_len, TYPICAL_SEQUENCE_TOKENS)
    wanted = max_num_seqs * length * per_token
    sized = f"max_num_seqs {max_num_seqs} x {length} tokens x {format_bytes(per_token)}/token"
    budget, reason = wanted, sized
    if host.weights < budget:
        budget, reason = (
            host.weights,
            f"the weights' size, less than {sized} = {format_bytes(wanted)}",
        )
    if host.left is not None and host.left // 2 < budget:
        budget = host.left // 2
        reason = f"half the {format_bytes(host.left)} of memory left, less than {sized} = {format_bytes(wanted)}"
    one_sequence = -(-max_model_len // block_size) * block_size * per_token
    if budget < one_sequence:
        budget = one_sequence
        reason = (
            f"one max_model_len sequence: {max_model_len} tokens x {format_bytes(per_token)}/token"
        )
    return budget, reason


def gpu_kv_cache_bytes(use: GpuMemoryUse, *, utilization: float, reserve: int) -> int:
    """The KV-cache budget on a GPU: the engine's share of the memory free at start, less
    what it already holds, its peak activations and the CUDA-graph ``reserve``.

    Raises :class:`~inlinelm.errors.ConfigError` (``option="gpu_memory_utilization"``)
    when nothing is left.
    """
    share = int(use.free_at_start * utilization)
    budget = share - use.used - use.peak_activations - reserve
    if budget <= 0:
        mib = 2**20
        raise ConfigError(
            f"no GPU memory left for the KV cache: {share / mib:.0f} MiB allowed "
            f"(gpu_memory_utilization {utilization} of {use.free_at_start / mib:.0f} MiB free), "
            f"{use.used / mib:.0f} MiB weights and workspaces, "
            f"{use.peak_activations / mib:.0f} MiB peak activations, "
            f"{reserve / mib:.0f} MiB CUDA-graph reserve; raise gpu_memory_utilization, "
            "or lower max_num_batched_tokens or cuda_graph_memory_bytes",
            option="gpu_memory_utilization",
        )
    return budget


def profile_gpu_memory(
    config: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    free_at_start: int | None,
    *,
    forward: DummyForward,
    sample: Sample,
) -> GpuMemoryUse | None:
    """On CUDA without an explicit cache size (``free_at_start`` measured, neither
    ``num_kv_blocks`` nor ``kv_cache_bytes`` set): measure what the loaded runner holds and
    the activation peak of a forward over ``max_num_batched_tokens`` tokens (one sequence,
    logits for up to ``max_num_seqs`` rows) and its costliest sampling; else None."""
    if free_at_start is None or config.num_kv_blocks is not None:
        return None
    if config.kv_cache_bytes is not None:
        return None
    n = min(config.max_num_batched_tokens, max_model_len)
    num_logits = min(config.max_num_seqs, n)
    peak = activation_peak(config, cfg, dtype, device, n, num_logits, forward, sample)
    torch.cuda.empty_cache()
    used = free_at_start - free_device_memory(device)
    logger.info(
        "GPU memory: %.0f MiB free at start, %.0f MiB weights and workspaces, "
        "%.0f MiB peak activations at %d tokens",
        free_at_start / 2**20,
        used / 2**20,
        peak / 2**20,
        n,
    )
    return GpuMemoryUse(free_at_start, used, peak)


@torch.inference_mode()
def activation_peak(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    n: int,
    num_logits: int,
    forward: DummyForward,
    sample: Sample,
) -> int:
    """Peak bytes of a forward over ``n`` tokens and the costliest sampling of its
    ``num_logits`` rows, on a scratch cache just big enough."""
    block_size = config.block_size
    scratch = allocate_kv_cache(-(-n // block_size), block_size, cfg, dtype, device)

    def step() -> None:
        logits = forward(n, num_logits, scratch)
        sample(logits, costliest_sampling(logits.shape[0], config, cfg.vocab_size, device))

    return peak_memory_of(device, step)


def costliest_sampling(
    rows: int, config: EngineConfig, vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampling metadata for ``rows`` rows with top-k, top-p, penalties and the most
    logprobs: every ``[rows, vocab]`` temporary the sampler can make."""
    params = SamplingParams(
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=config.max_logprobs,
    )
    return SamplingMetadata.build(
        [params] * rows,
        [[0]] * rows,
        [[0]] * rows,
        [None] * rows,
        vocab_size=vocab_size,
        device=device,
    )


def kv_cache_spec(
    config: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    gpu_memory: GpuMemoryUse | None = None,
    host: HostMemory | None = None,
) -> KVCacheSpec:
    """Size the cache: explicit blocks, else a byte budget: ``kv_cache_bytes``, the GPU
    budget when ``gpu_memory`` was measured, else the CPU default bounded by ``host``.

    Raises :class:`~inlinelm.errors.ConfigError` (``option="max_model_len"``) when a byte
    budget cannot hold one ``max_model_len`` sequence (explicit ``num_kv_blocks`` are
    taken as given)."""
    per_block = bytes_per_block(cfg, config.block_size, dtype)
    if config.num_kv_blocks is not None:
        return KVCacheSpec(config.num_kv_blocks, config.block_size, per_block, "num_kv_blocks")
    budget = config.kv_cache_budget
    reason = f"kv_cache_bytes={config.kv_cache_bytes!r}"
    if budget is None and gpu_memory is not None:
        budget = gpu_kv_cache_bytes(
            gpu_memory,
            utilization=config.gpu_memory_utilization,
            reserve=0 if config.enforce_eager else config.cuda_graph_memory_bytes,
        )
        reason = f"gpu_memory_utilization {config.gpu_memory_utilization} of the free memory"
    if budget is None:
        assert host is not None, "the CPU default needs the host's memory bounds"
        budget, reason = cpu_kv_cache_bytes(
            bytes_per_token(cfg, dtype),
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            block_size=config.block_size,
            host=host,
        )
    num_blocks = budget // per_block
    _check_holds_one_sequence(num_blocks, config.block_size, max_model_len, budget)
    return KVCacheSpec(max(int(num_blocks), 2), config.block_size, per_block, reason)


def _check_holds_one_sequence(
    num_blocks: int, block_size: int, max_model_len: int, budget: int
) -> None:
    """A byte budget must hold one sequence of ``max_model_len`` tokens, or a long request
    could never finish; the error names the options that fix it."""
    if num_blocks >= -(-max_model_len // block_size):
        return
    raise ConfigError(
        f"the KV cache budget ({budget / 2**20:.0f} MiB: {num_blocks} blocks = "
        f"{num_blocks * block_size} tokens) cannot hold one sequence of max_model_len="
        f"{max_model_len} tokens; lower max_model_len, or raise kv_cache_bytes, "
        "num_kv_blocks or gpu_memory_utilization",
        option="max_model_len",
    )


def allocate_kv_cache(
    num_blocks: int, block_size: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks * block_size, num_kv_heads, head_dim] tensor per layer (K, V),
    views of one allocation (on a CPU, a mapping whose pages are committed as they are
    written: see the module docstring)."""
    shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    # NOTE: zeros, not empty: padded gather positions read real slots, and NaN garbage
    # would poison the masked softmax product. A fresh anonymous mapping reads as zeros.
    if device.type == "cpu":
        cache = _mapped_zeros(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return list(cache.unbind(0))


def _mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on its own private anonymous mapping (page-aligned; unmapped when
    the last view of it is freed). Shared mappings would commit pages on reads too."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no private anonymous mappings
        return torch.zeros(shape, dtype=dtype)
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, count * itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write this step's ``k``/``v`` [T, KVH, D] into ``kv_cache`` [2, slots, KVH, D]
    (rounded to the cache's dtype where it is narrower: ``kv_cache_dtype``).

    One ``index_copy_`` along the slot dimension when ``v`` lies right after ``k`` in one
    buffer (the fused QKV projection's, when RoPE ran in place); two otherwise.
    """
    pair = adjacent_pair(k, v)
    if pair is not None:
        kv_cache.index_copy_(1, slot_mapping, pair.to(kv_cache.dtype))
        return
    kv_cache[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def adjacent_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``k`` and ``v`` [T, KVH, D] as one strided [2, T, KVH, D] view, when ``v`` starts
    where ``k``'s heads end in every row of the same buffer; else None."""
    if k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or k.dim() != 3:
        return None
    step = k.shape[1] * k.stride(1)
    if (
        k.stride(2) != 1
        or k.stride(1) != k.shape[2]
        or v.storage_offset() - k.storage_offset() != step
    ):
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    return k.as_strided((2, *k.shape), (step, *k.stride()))


def format_bytes(num_bytes: int) -> str:
    """``1.5 GiB``, ``4.0 TiB``: the largest binary unit that keeps the number above 1."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"


def free_device_memory(device: torch.device) -> int:
    """Free memory on CUDA ``device`` by the driver's count, after pending work (CUDA only)."""
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def peak_memory_of(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes ``run()`` allocated on CUDA ``device`` at its peak, above what was allocated
    before it (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)
