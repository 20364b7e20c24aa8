"""The model runner: the only code that builds tensors for a step (engine thread)."""

from __future__ import annotations

import gc
import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

from inlinelm.config import EngineConfig
from inlinelm.errors import RequestError
from inlinelm.gpu.attention import AttentionMetadata
from inlinelm.gpu.attention_backends import make_attention_backend, select_attention_backend
from inlinelm.gpu.input_batch import InputBatch, IntArray, StepInputs
from inlinelm.gpu.kernels import make_kernels
from inlinelm.gpu.kv_cache import (
    GpuMemoryUse,
    allocate_kv_cache,
    free_device_memory,
    kv_cache_spec,
    peak_memory_of,
)
from inlinelm.gpu.model_config import ModelConfig
from inlinelm.gpu.sampler import Sampler, to_token_logprobs
from inlinelm.gpu.sampling_metadata import SamplingMetadata
from inlinelm.gpu.weights import load_model
from inlinelm.sched.output import ModelRunnerOutput, SchedulerOutput
from inlinelm.sched.request import Request

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class ModelRunner:
    """Loads the model, owns the paged KV cache and the persistent batch, runs steps."""

    def __init__(self, config: EngineConfig, folder: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.model_dtype]
        self.model_config = ModelConfig.from_folder(folder)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        free_at_start = free_device_memory(self.device) if self.device.type == "cuda" else None
        # NOTE: one choice for attention and the model's other kernels: FlashInfer for all,
        # or torch for all (the torch path is the reference the device tests compare to).
        self.kernels_kind = select_attention_backend(
            config.attention_backend, self.device, self.dtype
        )
        self.backend = make_attention_backend(
            self.kernels_kind,
            self.device,
            self.model_config.num_heads,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
        )
        self.model = load_model(
            folder,
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            max_positions=self.max_model_len,
            kernels=make_kernels(self.kernels_kind),
        )
        self.kv_spec = kv_cache_spec(
            config,
            self.model_config,
            self.max_model_len,
            self.dtype,
            self._profile_gpu_memory(free_at_start),
        )
        self.num_kv_blocks = self.kv_spec.num_blocks
        self.kv_caches = self._allocate_kv_cache()
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, config.block_size)
        self.sampler = Sampler()
        # Every core, for decode too: oneDNN splits even a one-row GEMV over the intra-op
        # threads (see docs/architecture.md, "CPU threads").
        self.num_threads = config.num_threads or _num_cores()
        self._current_threads = 0
        self._prepared_thread: int | None = None
        self._closed = False

    def _profile_gpu_memory(self, free_at_start: int | None) -> GpuMemoryUse | None:
        """On CUDA without an explicit cache size: measure what the weights hold and the
        activation peak of a forward over ``max_num_batched_tokens`` tokens (one sequence,
        logits for up to ``max_num_seqs`` rows)."""
        config = self.config
        if free_at_start is None or config.num_kv_blocks is not None:
            return None
        if config.kv_cache_bytes is not None:
            return None
        n = min(config.max_num_batched_tokens, self.max_model_len)
        peak = self._activation_peak(n, min(config.max_num_seqs, n))
        torch.cuda.empty_cache()
        used = free_at_start - free_device_memory(self.device)
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
    def _activation_peak(self, n: int, num_logits: int) -> int:
        """Peak bytes of a forward over ``n`` tokens, on a scratch cache just big enough."""
        block_size = self.config.block_size
        scratch = allocate_kv_cache(
            -(-n // block_size), block_size, self.model_config, self.dtype, self.device
        )
        return peak_memory_of(self.device, lambda: self._dummy_forward(n, num_logits, scratch))

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        spec = self.kv_spec
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB",
            spec.num_blocks,
            spec.block_size,
            spec.num_blocks * spec.bytes_per_block / 2**20,
        )
        return allocate_kv_cache(
            spec.num_blocks, spec.block_size, self.model_config, self.dtype, self.device
        )

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
        """Run a short prefill and one decode step, so the first real steps do not pay for
        lazy initialisation (on CUDA: library handles, FlashInfer's kernel builds)."""
        self._prepare_thread()
        n = max(2, min(16, self.config.block_size, self.max_model_len - 1))
        self._dummy_forward(n - 1, 1, self.kv_caches)
        self._dummy_forward(n, 1, self.kv_caches, start=n - 1)

    def _dummy_forward(
        self, n: int, num_logits: int, kv_caches: list[torch.Tensor], start: int = 0
    ) -> None:
        """Run positions ``start..n-1`` of one sequence of zero tokens whose cache is the
        first blocks of ``kv_caches``; logits for the last ``num_logits`` positions."""
        new = n - start
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, n, device=self.device),
            query_start_loc=torch.tensor([0, new], device=self.device),
            seq_lens=torch.tensor([n], device=self.device),
            block_tables=torch.arange(-(-n // self.config.block_size), device=self.device)[None],
            max_query_len=new,
            max_seq_len=n,
        )
        self.backend.prepare(meta, self.config.block_size)
        self.model(
            torch.zeros(new, dtype=torch.int64, device=self.device),
            torch.arange(start, n, device=self.device),
            kv_caches,
            meta,
            torch.arange(new - num_logits, new, device=self.device),
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
        """Release the KV cache, the weights, the attention workspaces and the CUDA graphs
        (when captured), so their device memory returns to the driver; idempotent.

        A later runner in the same process starts from the same free memory, give or take
        the CUDA libraries' per-thread state (cuBLAS workspaces, loaded kernels).
        """
        if self._closed:
            return
        self._closed = True
        for name in _RELEASED_ON_CLOSE:
            _close_part(self.__dict__.pop(name, None))
        # NOTE: modules and FlashInfer wrappers can sit in reference cycles; collect them
        # before the allocator's cached blocks go back to the driver.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


_RELEASED_ON_CLOSE = ("graphs", "kv_caches", "model", "backend", "sampler", "batch")
"""Runner attributes dropped by :meth:`ModelRunner.close` (each closed first if it can be)."""


def _close_part(part: object) -> None:
    close = getattr(part, "close", None)
    if callable(close):
        close()


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
