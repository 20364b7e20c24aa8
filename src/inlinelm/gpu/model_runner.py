"""The model runner: the only code that builds tensors for a step (engine thread)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import RequestError
from inlinelm.gpu.attention import AttentionMetadata, TorchAttention
from inlinelm.gpu.input_batch import InputBatch, IntArray, StepInputs
from inlinelm.gpu.model_config import ModelConfig
from inlinelm.gpu.sampler import Sampler, to_token_logprobs
from inlinelm.gpu.sampling_metadata import SamplingMetadata
from inlinelm.gpu.weights import load_model
from inlinelm.sched.output import ModelRunnerOutput, SchedulerOutput
from inlinelm.sched.request import Request

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_CACHE_BYTES_CAP = 2 * 1024**3


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """How many blocks the cache holds and what one block costs."""

    num_blocks: int
    block_size: int
    bytes_per_block: int


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    """The context length served: the engine option, capped by the model's own limits."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        limit = min(limit, cfg.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise RequestError(
            f"max_model_len {config.max_model_len} exceeds the model's limit {limit}",
            param="max_model_len",
        )
    return config.max_model_len


def kv_cache_spec(
    config: EngineConfig, cfg: ModelConfig, max_model_len: int, dtype: torch.dtype
) -> KVCacheSpec:
    """Size the cache: explicit blocks, else a byte budget (CPU) or a memory fraction (CUDA)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_per_block = (
        config.block_size * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    )
    if config.num_kv_blocks is not None:
        return KVCacheSpec(config.num_kv_blocks, config.block_size, bytes_per_block)
    budget = config.kv_cache_bytes
    if budget is None and config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(free * config.gpu_memory_utilization)
    if budget is None:
        full_context = (
            -(-max_model_len // config.block_size) * config.max_num_seqs * bytes_per_block
        )
        budget = min(full_context, DEFAULT_KV_CACHE_BYTES_CAP)
    num_blocks = budget // bytes_per_block
    if num_blocks < -(-max_model_len // config.block_size):
        logger.warning("KV cache of %d blocks holds less than one full-length sequence", num_blocks)
    return KVCacheSpec(max(int(num_blocks), 2), config.block_size, bytes_per_block)


class ModelRunner:
    """Loads the model, owns the paged KV cache and the persistent batch, runs steps."""

    def __init__(self, config: EngineConfig, folder: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.model_config = ModelConfig.from_folder(folder)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.backend = TorchAttention(
            self.model_config.num_heads, self.model_config.num_kv_heads, self.model_config.head_dim
        )
        self.model = load_model(
            folder,
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            max_positions=self.max_model_len,
        )
        self.kv_spec = kv_cache_spec(config, self.model_config, self.max_model_len, self.dtype)
        self.num_kv_blocks = self.kv_spec.num_blocks
        self.kv_caches = self._allocate_kv_cache()
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, config.block_size)
        self.sampler = Sampler()
        # Every core, for decode too: oneDNN splits even a one-row GEMV over the intra-op
        # threads (see docs/architecture.md, "CPU threads").
        self.num_threads = config.num_threads or _num_cores()
        self._current_threads = 0
        self._prepared_thread: int | None = None

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        cfg, spec = self.model_config, self.kv_spec
        slots = spec.num_blocks * spec.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB",
            spec.num_blocks,
            spec.block_size,
            spec.num_blocks * spec.bytes_per_block / 2**20,
        )
        # NOTE: zeros, not empty: padded gather positions read real slots, and NaN garbage
        # would poison the masked softmax product.
        cache = torch.zeros(
            cfg.num_layers,
            2,
            slots,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        return list(cache.unbind(0))

    def _prepare_thread(self) -> None:
        """Per-thread CPU settings, applied on whichever thread runs the model.

        Denormal floats make x86 arithmetic up to ~10x slower (seen here at batch 32 on the
        default model), so they are flushed to zero; the flag is per thread and is
        inherited by the intra-op worker threads this thread starts.
        """
        if self._prepared_thread == threading.get_ident():
            return
        self._prepared_thread = threading.get_ident()
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)

    def _set_threads(self) -> None:
        if self.device.type == "cpu" and self._current_threads != self.num_threads:
            torch.set_num_threads(self.num_threads)
            self._current_threads = self.num_threads

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update the persistent batch, forward, sample, record the tokens."""
        self._prepare_thread()
        # 1) forget rows the scheduler dropped, add and sync the scheduled ones
        for request_id in batch.removed_ids:
            self.batch.remove(request_id)
        rows, num_scheduled, num_computed = self._sync_rows(batch)
        # 2) build the flat inputs and run the model on the rows that sample
        inputs = self.batch.prepare(rows, num_scheduled, num_computed)
        self._set_threads()
        logits = self._forward(inputs)
        if len(inputs.sampling_rows) == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        # 3) sample and append the new tokens to the persistent rows
        return self._sample(batch, inputs, logits)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run one short forward so the first real step does not pay for lazy initialisation."""
        self._prepare_thread()
        n = min(16, self.config.block_size, self.max_model_len - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            query_start_loc=torch.tensor([0, n], device=self.device),
            seq_lens=torch.tensor([n], device=self.device),
            block_tables=torch.zeros(1, 1, dtype=torch.int64, device=self.device),
            max_query_len=n,
            max_seq_len=n,
        )
        self.backend.prepare(meta, self.config.block_size)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.model(
            ids,
            torch.arange(n, device=self.device),
            self.kv_caches,
            meta,
            torch.tensor([n - 1], device=self.device),
        )

    def _sync_rows(self, batch: SchedulerOutput) -> tuple[IntArray, IntArray, IntArray]:
        count = len(batch.scheduled)
        rows = np.empty(count, dtype=np.int64)
        num_scheduled = np.empty(count, dtype=np.int64)
        num_computed = np.empty(count, dtype=np.int64)
        for i, item in enumerate(batch.scheduled):
            request = item.request
            row = self.batch.row_of.get(request.request_id)
            if row is None:
                row = self.batch.add(request, _generator(request.params.seed, self.device))
            self.batch.sync_blocks(row, request.block_ids)
            rows[i], num_scheduled[i], num_computed[i] = (
                row,
                item.num_tokens,
                request.num_computed_tokens,
            )
        return rows, num_scheduled, num_computed

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(inputs.slot_mapping),
            query_start_loc=to(inputs.query_start_loc),
            seq_lens=to(inputs.seq_lens),
            block_tables=to(inputs.block_tables),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )
        self.backend.prepare(meta, self.config.block_size)
        logits: torch.Tensor = self.model(
            to(inputs.input_ids),
            to(inputs.positions),
            self.kv_caches,
            meta,
            to(inputs.logits_indices),
        )
        return logits

    def _to_device(self, array: IntArray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _sample(
        self, batch: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor
    ) -> ModelRunnerOutput:
        requests = [batch.scheduled[int(i)].request for i in inputs.sampling_positions]
        meta = SamplingMetadata.build(
            [r.params for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            [self.batch.generators[int(row)] for row in inputs.sampling_rows],
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )
        self._suppress_early_stops(logits, requests)
        out = self.sampler(logits, meta)
        sampled = out.sampled.cpu().numpy().astype(np.int64)
        self.batch.append_tokens(inputs.sampling_rows, sampled)
        return ModelRunnerOutput(
            req_ids=[r.request_id for r in requests],
            sampled_token_ids=sampled.tolist(),
            logprobs=to_token_logprobs(out, meta.num_logprobs)
            if meta.max_num_logprobs is not None
            else None,
        )

    def _suppress_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Ban EOS and stop tokens for rows that have not reached ``min_tokens`` yet."""
        for i, request in enumerate(requests):
            params = request.params
            if params.min_tokens and len(request.output_token_ids) < params.min_tokens:
                banned = list(params.stop_token_ids)
                if request.eos_token_id is not None and not params.ignore_eos:
                    banned.append(request.eos_token_id)
                logits[i, banned] = float("-inf")

    def close(self) -> None:
        """Drop the weights and the KV cache so their memory can be returned."""
        self.kv_caches = []
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _num_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device)
    generator.manual_seed(seed)
    return generator
