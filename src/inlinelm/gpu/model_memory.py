"""Whether a model fits this machine, judged from its config before anything is allocated.

:func:`memory_parts` counts what the runner allocates up front, by arithmetic on the
config (a 4 TiB embedding is refused in microseconds, a billion layers without listing
them):

- the weights, in the model's dtype, or their blocks' bytes for the layers that keep
  block-quantized weights; our model keeps its own float LM head even when the checkpoint
  ties it to the embedding (a quantized one shares the embedding's);
- the rotary cos/sin table (float32, one row per position up to ``max_model_len``);
- the persistent batch's token and block tables (int64, ``max_num_seqs`` rows);
- the KV cache, when its size is fixed before loading: always on a CPU, on CUDA only with
  ``num_kv_blocks`` or ``kv_cache_bytes`` (otherwise it takes what is left, and
  ``gpu_kv_cache_bytes`` judges that after the weights are in);
- the largest checkpoint tensor, read into host memory before it is copied.

:func:`check_fits` refuses a model whose parts exceed the memory there is: on a CPU all of
them against the host's available memory; on CUDA the weights, the rotary table and a
fixed KV cache against the device's free memory, the tables against the host's. The rule
refuses only what certainly cannot fit (activations and allocator slack come on top), and
blames the largest part: the config.json field that sized it (``ModelLoadError``), or the
engine option (``ConfigError``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError, ModelLoadError
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.kv_cache import HostMemory, KVCacheSpec, kv_cache_spec
from inlinelm.gpu.kv_cache import format_bytes as format_bytes  # re-exported: its old home
from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.layers.blocks import packed_bytes
from inlinelm.gpu.model.registry import build_model

logger = logging.getLogger(__name__)

_INT64 = 8
_FLOAT32 = 4


@dataclass(frozen=True, slots=True)
class MemoryPart:
    """One allocation the runner makes up front, and what decided its size."""

    what: str
    num_bytes: int
    on_device: bool  # False: host memory even when the model runs on CUDA
    blame: str  # the config.json field or the engine option that sized it
    is_option: bool = False


def memory_parts(
    config: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    blocks: Mapping[str, str] | None = None,
) -> list[MemoryPart]:
    """What loading ``cfg`` for ``config`` allocates up front (see the module docstring);
    the modules named in ``blocks`` keep block-quantized weights of their kinds
    (``weights.block_plan``)."""
    embedding, layers = weight_parts(cfg, dtype, blocks)
    length_blame = "max_model_len" if config.max_model_len is not None else _length_field(cfg)
    length_is_option = config.max_model_len is not None
    max_blocks = -(-max_model_len // config.block_size)
    parts = [
        MemoryPart(
            f"embedding and LM head: 2 x vocab_size {cfg.vocab_size} x hidden_size "
            f"{cfg.hidden_size}",
            embedding,
            on_device=True,
            blame="vocab_size",
        ),
        MemoryPart(
            f"decoder layers: num_hidden_layers {cfg.num_layers} x "
            f"{layers / cfg.num_layers / 2**20:.1f} MiB",
            layers,
            on_device=True,
            blame="num_hidden_layers",
        ),
        MemoryPart(
            f"rotary table: {max_model_len} positions x {cfg.rotated_dim} rotated dimensions",
            (1 + (cfg.local_rope is not None)) * max_model_len * cfg.rotated_dim * _FLOAT32,
            on_device=True,
            blame=length_blame,
            is_option=length_is_option,
        ),
        MemoryPart(
            f"batch tables: max_num_seqs {config.max_num_seqs} x {max_model_len} tokens",
            config.max_num_seqs * (max_model_len + max_blocks) * _INT64,
            on_device=False,
            blame=length_blame,
            is_option=length_is_option,
        ),
        loading_part(cfg, dtype),
    ]
    return parts


def check_model_memory(
    config: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    config_path: Path,
    blocks: Mapping[str, str] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> KVCacheSpec | None:
    """Refuse, before anything is allocated, a model this machine cannot hold (see the
    module docstring); reads only the memory counters. Returns the KV cache's spec when
    its size is fixed before loading (see :func:`up_front_kv_spec`; a cache of
    ``kv_dtype``, by default the model's ``dtype``), else None."""
    device = torch.device(config.device)
    device_free = device_memory_free(device) if device.type == "cuda" else None
    host_free = host_memory_available()
    parts = memory_parts(config, cfg, max_model_len, dtype, blocks)
    # NOTE: the model's own parts first: a model that cannot fit is blamed on its config,
    # before the KV sizing can complain about a max_model_len the config chose.
    check_fits(parts, device_free=device_free, host_free=host_free, config_path=config_path)
    left = None if host_free is None else host_free - sum(p.num_bytes for p in parts)
    host = HostMemory(weight_bytes(cfg, dtype), left)
    spec = up_front_kv_spec(config, cfg, max_model_len, kv_dtype or dtype, host)
    if spec is not None:
        parts.append(kv_cache_part(config, spec))
        check_fits(parts, device_free=device_free, host_free=host_free, config_path=config_path)
    logger.info(
        "memory: %s up front (%s free%s)",
        format_bytes(sum(p.num_bytes for p in parts)),
        format_bytes(device_free if device_free is not None else host_free or 0),
        " on the GPU" if device_free is not None else "",
    )
    return spec


def up_front_kv_spec(
    config: EngineConfig, cfg: ModelConfig, max_model_len: int, dtype: torch.dtype, host: HostMemory
) -> KVCacheSpec | None:
    """The KV cache's spec when its size is fixed before loading: always on a CPU (the
    default bounded by ``host``), on CUDA only with ``num_kv_blocks`` or ``kv_cache_bytes``.

    May raise ``kv_cache_spec``'s ``ConfigError``: a budget too small for one sequence.
    """
    sized_up_front = config.num_kv_blocks is not None or config.kv_cache_bytes is not None
    if torch.device(config.device).type == "cuda" and not sized_up_front:
        return None
    return kv_cache_spec(config, cfg, max_model_len, dtype, host=host)


def kv_cache_part(config: EngineConfig, spec: KVCacheSpec) -> MemoryPart:
    """The KV cache of ``spec`` (and its scratch block) as a part to check."""
    option = "num_kv_blocks" if config.num_kv_blocks is not None else "kv_cache_bytes"
    return MemoryPart(
        f"KV cache: {spec.num_blocks + 1} blocks of {spec.block_size} tokens",
        (spec.num_blocks + 1) * spec.bytes_per_block,
        on_device=True,
        blame=option,
        is_option=True,
    )


def loading_part(cfg: ModelConfig, dtype: torch.dtype) -> MemoryPart:
    """The largest checkpoint tensor, read into host memory before it is copied."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(cfg.vocab_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    return MemoryPart(
        f"the largest tensor while it is read: {rows} x hidden_size {cfg.hidden_size}",
        rows * cfg.hidden_size * itemsize,
        on_device=False,
        blame="vocab_size" if rows == cfg.vocab_size else "hidden_size",
    )


def check_fits(
    parts: list[MemoryPart],
    *,
    device_free: int | None,
    host_free: int | None,
    config_path: Path,
) -> None:
    """Refuse ``parts`` that exceed the memory there is.

    ``device_free`` is the CUDA device's free memory, None on a CPU (every part is then
    host memory); ``host_free`` the host's available memory, None when unknown (then only
    the device is judged). Raises ``ModelLoadError`` (naming ``config_path`` and the
    field) or ``ConfigError`` (naming the option) for the largest part of the side that
    does not fit.
    """
    if device_free is None:
        _check_side(parts, host_free, "memory available", config_path)
        return
    _check_side([p for p in parts if p.on_device], device_free, "free GPU memory", config_path)
    _check_side([p for p in parts if not p.on_device], host_free, "memory available", config_path)


def _check_side(
    parts: list[MemoryPart], available: int | None, where: str, config_path: Path
) -> None:
    need = sum(p.num_bytes for p in parts)
    if available is None or need <= available:
        return
    largest = max(parts, key=lambda p: p.num_bytes)
    listed = "; ".join(f"{p.what}: {format_bytes(p.num_bytes)}" for p in parts)
    message = (
        f"the model needs {format_bytes(need)} but this machine has {format_bytes(available)} "
        f"of {where} ({listed})"
    )
    if largest.is_option:
        raise ConfigError(f"{message}; lower {largest.blame}", option=largest.blame)
    hint = "; serve a shorter context with max_model_len" if largest.blame in _LENGTH_FIELDS else ""
    raise ModelLoadError(message + hint, path=str(config_path), field=largest.blame)


_LENGTH_FIELDS = ("max_position_embeddings",)


def _length_field(cfg: ModelConfig) -> str:
    """The config.json field that set the context length (see ``resolve_max_model_len``)."""
    return "max_position_embeddings"


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The model's weights in ``dtype``: embedding, LM head, final norm and every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(param_counts(cfg)) * itemsize


def weight_parts(
    cfg: ModelConfig, dtype: torch.dtype, blocks: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """Bytes of (the embedding, the LM head and the final norm; all decoder layers) with
    the modules of ``blocks`` holding block-quantized weights of their kinds (their
    tiles' bytes, ``layers.blocks.packed_bytes``; a bias in float32; a tied quantized head
    reads the embedding's, so it takes none) and the rest ``dtype``."""
    return _weight_parts(cfg, dtype, tuple(sorted((blocks or {}).items())))


@functools.cache
def _weight_parts(
    cfg: ModelConfig, dtype: torch.dtype, block_items: tuple[tuple[str, str], ...]
) -> tuple[int, int]:
    blocks = dict(block_items)
    itemsize = torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):
        backend = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        model = build_model(cfg, backend, 1, None)
    sizes = [0, 0]
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if name not in blocks or pname == "bias":
                size = param.numel() * (_FLOAT32 if name in blocks else itemsize)
            elif name == "lm_head" and cfg.tie_word_embeddings:
                size = 0
            else:  # an Embedding's weight [rows, in], a Linear's weight_t [in, rows]
                rows, cols = param.shape if pname == "weight" else reversed(param.shape)
                size = packed_bytes(blocks[name], rows, cols)
            sizes[name.startswith("layers.")] += size
    return sizes[0], sizes[1]


@functools.cache
def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """The parameters of ``cfg``'s model: (the embedding, the LM head (ours is its own even
    when the checkpoint ties it) and the final norm; all decoder layers). Counted on a
    model built on the meta device, so every family's layers count as they are."""
    with torch.device("meta"):
        backend = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        model = build_model(cfg, backend, 1, None)
    layers = sum(p.numel() for p in model.layers.parameters())
    return sum(p.numel() for p in model.parameters()) - layers, layers


def return_free_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); False
    where there is no glibc.

    torch frees a CPU tensor into malloc, and glibc keeps what a thread freed in that
    thread's arena: the default model's loading temporaries (~240 MiB) and, after
    ``close()``, its weights (~600 MiB) stayed in the process's resident memory without it.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def host_memory_available() -> int | None:
    """Bytes the host can still give this process: Linux's MemAvailable, capped by a
    cgroup v2 memory limit; None where neither can be read."""
    available = _meminfo_available()
    limit = _cgroup_headroom()
    if available is None:
        return limit
    return available if limit is None else min(available, limit)


def device_memory_free(device: torch.device) -> int:
    """Free memory on CUDA ``device``, by the driver's count."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _meminfo_available() -> int | None:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            return int(rest.split()[0]) * 1024
    return None


def _cgroup_headroom() -> int | None:
    """What a cgroup v2 memory limit leaves this process: the limit less the group's
    working set (its usage without the inactive file cache, which the kernel reclaims
    first). None without a limit or a cgroup."""
    folder = Path("/sys/fs/cgroup")
    try:
        limit = (folder / "memory.max").read_text().strip()
        current = int((folder / "memory.current").read_text().strip())
        stat = (folder / "memory.stat").read_text().split()
    except (OSError, ValueError):
        return None
    if not limit.isdigit():  # "max": no limit
        return None
    counters = dict(zip(stat[::2], stat[1::2], strict=False))
    inactive_file = int(counters.get("inactive_file", "0"))
    return max(int(limit) - (current - inactive_file), 0)
