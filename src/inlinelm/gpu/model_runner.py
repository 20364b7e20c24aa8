"""The model runner: the only code that builds tensors for a step (engine thread)."""

from __future__ import annotations

import gc
import logging
import threading
from collections import deque
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu.attention.metadata import AttentionMetadata, IntArray
from inlinelm.gpu.attention.select import make_attention_backend, select_attention_backend
from inlinelm.gpu.cpu_threads import CpuThreads
from inlinelm.gpu.cuda_graphs import DecodeGraphs, build_decode_graphs, graphs_capturable
from inlinelm.gpu.input_batch import InputBatch
from inlinelm.gpu.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    format_bytes,
    free_device_memory,
    kv_cache_spec,
    profile_gpu_memory,
)
from inlinelm.gpu.loading.weights import load_model
from inlinelm.gpu.model.cpu_extension import cpu_ops
from inlinelm.gpu.model.kernels import make_kernels
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.rope import long_context_from
from inlinelm.gpu.model_fit import DTYPES, ModelFit, check_model_fits
from inlinelm.gpu.model_memory import return_free_heap
from inlinelm.gpu.prompt_outputs import PoolSums, PromptOutputs
from inlinelm.gpu.sampling.sampler import Sampler, flashinfer_sampling
from inlinelm.gpu.sampling.step_sampling import StepSampling, seeded_generator
from inlinelm.gpu.staging import HostStaging
from inlinelm.gpu.step_forward import RunModel, one_sequence_metadata, stage_forward
from inlinelm.gpu.step_output import StepInFlight
from inlinelm.sched.output import SchedulerOutput
from inlinelm.sched.runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads the model, owns the paged KV cache and the persistent batch, runs steps.

    ``fit`` is the loader's :func:`~inlinelm.gpu.model_fit.check_model_fits` of ``config``
    and ``folder`` (the one place ``max_model_len`` is resolved); a runner built without
    one (tests, benchmarks) checks the fit itself.
    """

    def __init__(self, config: EngineConfig, folder: Path, fit: ModelFit | None = None) -> None:
        self.config = config
        self.device = runner_device(config.device)
        self.dtype = DTYPES[config.model_dtype]
        # NOTE: first, so the first interval it measures ends by the first step.
        self.cpu_threads = CpuThreads(config.num_threads) if self.device.type == "cpu" else None
        fit = fit or check_model_fits(config, folder)
        self.model_config, self.max_model_len = fit.model_config, fit.max_model_len
        self.kv_dtype = fit.kv_dtype
        free_at_start = free_device_memory(self.device) if self.device.type == "cuda" else None
        self._resolve_parts()
        self.model = self._load_model(folder)
        self.sampler = Sampler(flashinfer_sampling(self.device))
        # NOTE: the spec sized before loading, when there is one: the host memory it was
        # bounded by is what the weights now hold.
        self.kv_spec = fit.kv_spec or self._size_kv_cache(free_at_start)
        self.num_kv_blocks = self.kv_spec.num_blocks
        self.kv_caches = self._allocate_kv_cache()
        self.long_context_from = long_context_from(self.model_config.rope)
        self.batch = InputBatch(
            config.max_num_seqs, self.max_model_len, config.block_size, self.long_context_from
        )
        self._init_step_state()
        # Loading freed its temporaries (file reads, unpacked copies) into malloc's arenas.
        return_free_heap()

    def _resolve_parts(self) -> None:
        """The kernels and the attention backend for the model on this device."""
        cfg = self.model_config
        # NOTE: one choice for attention and the model's other kernels: FlashInfer for all,
        # or torch for all (the torch path is the reference the device tests compare to).
        self.kernels_kind = select_attention_backend(
            self.config.attention_backend, self.device, self.dtype, head_dim=cfg.head_dim
        )
        torch_kind = self.kernels_kind == "torch"
        self.cpu_ops = cpu_ops(self.device, self.dtype) if torch_kind else None
        self.backend = make_attention_backend(
            self.kernels_kind,
            self.device,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            cfg.attention_kinds,
            cpu_ops=self.cpu_ops,
        )

    def _load_model(self, folder: Path) -> DecoderModel:
        return load_model(
            folder,
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            max_positions=self.max_model_len,
            kernels=make_kernels(self.kernels_kind, self.cpu_ops),
            quantization=self.config.weight_quantization,
        )

    def _size_kv_cache(self, free_at_start: int | None) -> KVCacheSpec:
        """The cache's size once loaded: on CUDA, measured around the model (see
        :func:`~inlinelm.gpu.kv_cache.profile_gpu_memory`)."""
        cfg, length = self.model_config, self.max_model_len
        use = profile_gpu_memory(
            self.config,
            cfg,
            length,
            self.kv_dtype,
            self.device,
            free_at_start,
            forward=self._dummy_forward,
            sample=self.sampler,
        )
        return kv_cache_spec(self.config, cfg, length, self.kv_dtype, use)

    def _init_step_state(self) -> None:
        """Step path: decode graphs (built at the first step), the sampling state kept across
        steps (the last token sampled in each batch row, read on the device by the next
        step's decodes), steps submitted but not collected, thread settings."""
        config = self.config
        self.scratch_block = self.num_kv_blocks  # the cache's extra block, never in the pool
        self.graphs: DecodeGraphs | None = None
        self._graphs_built = False
        self._step_sampling = StepSampling(
            config.max_num_seqs, self.model_config.vocab_size, self.device
        )
        self._in_flight: deque[StepInFlight] = deque()
        self._pool_sums: PoolSums = {}
        # Live rows whose requests pool or want prompt logprobs (most steps have none).
        self._prompt_ids: set[str] = set()
        self._current_threads = 0
        self._prepared_thread: int | None = None
        self._closed = False

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        spec = self.kv_spec
        logger.info(
            "KV cache: %d blocks of %d tokens = %s (%s)%s; set kv_cache_bytes= to change",
            spec.num_blocks,
            spec.block_size,
            format_bytes(spec.num_blocks * spec.bytes_per_block),
            spec.reason,
            ", committed as it fills" if self.device.type == "cpu" else "",
        )
        # NOTE: one block more than the pool hands out: the scratch block that padding rows
        # of a graphed decode write to.
        return allocate_kv_cache(
            spec.num_blocks + 1, spec.block_size, self.model_config, self.kv_dtype, self.device
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
        """Run the step on the cores other processes leave idle, or on ``num_threads``
        (see :mod:`inlinelm.gpu.cpu_threads`); oneDNN splits even a one-row GEMV over them."""
        if self.cpu_threads is None:
            return
        wanted = self.cpu_threads.current()
        if wanted != self._current_threads:
            torch.set_num_threads(wanted)
            self._current_threads = wanted

    @property
    def overlaps(self) -> bool:
        """True when the device computes while the engine thread schedules (CUDA).

        On a CPU the model computes on the engine thread itself, so submit/collect are a
        plain split of :meth:`execute` and the loader keeps the plain engine loop; the
        pipelined loop still drives this runner correctly (tests select it).
        """
        return self.device.type == "cuda"

    @torch.inference_mode()
    def start_on_thread(self) -> None:
        """On CUDA: make the runner's device current on the engine thread and capture the
        decode graphs there (capture and replay belong to one thread), before the first
        request, so none of them waits for it (see ``Runner.start_on_thread``).

        Runs in inference mode, as every step does: the capture's warm-up writes the KV
        cache in place, which autograd would refuse on a view of it.
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._ensure_graphs()

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        self.submit(batch)
        return self.collect()

    @torch.inference_mode()
    def submit(self, batch: SchedulerOutput) -> None:
        """Launch one step: update the persistent batch, forward, sample, start the copy of
        the sampled ids to the host. Returns without waiting for the device.

        A decode whose input token is sampled by a step still in flight reads it on the
        device, from the last token sampled in its row. Everything the host sends for the
        step goes in one non-blocking copy (:class:`~inlinelm.gpu.staging.HostStaging`).
        """
        self._prepare_thread()
        self._ensure_graphs()
        # 1) forget rows the scheduler dropped, add and sync the scheduled ones
        for request_id in batch.removed_ids:
            self.batch.remove(request_id)
            self._pool_sums.pop(request_id, None)
            self._prompt_ids.discard(request_id)
        rows, num_scheduled, starts, samples = self._sync_rows(batch)
        # 2) build the flat inputs and stage them with the sampling settings; one copy
        inputs = self.batch.prepare(rows, num_scheduled, starts, samples)
        staging = HostStaging(self.device)
        # NOTE: the per-request look runs only while such a request holds a row.
        prompt = PromptOutputs.of(batch, inputs) if self._prompt_ids else None
        run_model: RunModel = self._run_model
        if prompt is not None:
            run_model = prompt.forward(self.model, self.kv_caches, self._plan, self._pool_sums)
        # NOTE: a step with prompt outputs runs eagerly: a graph returns logits alone.
        graphs = self.graphs if prompt is None else None
        forward = stage_forward(
            inputs, staging, graphs, self._step_sampling.last_sampled, run_model
        )
        sample = self._step_sampling.stage(self.sampler, batch, inputs, self.batch, staging)
        staging.send()
        # 3) run the model on the rows that sample, sample on the device; the ids start on
        # their way to the host
        self._set_threads()
        step = sample(forward())
        if prompt is not None:
            step.pooled, step.prompt_logprobs = prompt.pooled, prompt.prompt_logprobs
        self._in_flight.append(step)

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest submitted step; return its tokens and record them in the
        rows that still belong to the same requests."""
        step = self._in_flight.popleft()
        step.wait()
        sampled = step.sampled.numpy()
        held = self.batch.requests
        rows = step.rows.tolist()
        if [held[row] for row in rows] == step.requests:  # identity: requests have no __eq__
            self.batch.append_tokens(step.rows, sampled)
        else:
            live = [i for i, row in enumerate(rows) if held[row] is step.requests[i]]
            self.batch.append_tokens(step.rows[live], sampled[live])
        return step.output(sampled)

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
    ) -> torch.Tensor:
        """Run positions ``start..n-1`` of one sequence of zero tokens whose cache is the
        first blocks of ``kv_caches``; logits for the last ``num_logits`` positions."""
        new = n - start
        return self._run_model(
            one_sequence_metadata(start, n, self.config.block_size, self.device),
            torch.zeros(new, dtype=torch.int64, device=self.device),
            torch.arange(start, n, device=self.device),
            torch.arange(new - num_logits, new, device=self.device),
            kv_caches,
        )

    def _plan(self, meta: AttentionMetadata) -> None:
        self.backend.prepare(meta, self.config.block_size)

    def _run_model(
        self,
        meta: AttentionMetadata,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Plan attention for ``meta`` once, then run every layer over ``kv_caches`` (the
        runner's cache when None); logits of the ``logits_indices`` tokens."""
        self.backend.prepare(meta, self.config.block_size)
        caches = self.kv_caches if kv_caches is None else kv_caches
        logits: torch.Tensor = self.model(input_ids, positions, caches, meta, logits_indices)
        return logits

    def _sync_rows(
        self, batch: SchedulerOutput
    ) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.bool_]]:
        # NOTE: whole-batch list comprehensions and one array each, not a loop writing numpy
        # items: this runs for every request every step.
        scheduled = batch.scheduled
        requests = [item.request for item in scheduled]
        row_of = self.batch.row_of
        row_list = [row_of.get(request.request_id) for request in requests]
        if None in row_list:
            for i, request in enumerate(requests):
                if row_list[i] is None:
                    row_list[i] = row = self.batch.add(
                        request, seeded_generator(request.params.seed, self.device)
                    )
                    self._step_sampling.add_row(row, request)
                    if request.pooling is not None or request.params.prompt_logprobs is not None:
                        self._prompt_ids.add(request.request_id)
        rows = np.array(row_list, dtype=np.int64)
        self.batch.sync_blocks(rows, [request.block_ids for request in requests])
        return (
            rows,
            np.array([item.num_tokens for item in scheduled], dtype=np.int64),
            np.array([item.start for item in scheduled], dtype=np.int64),
            np.array([item.samples for item in scheduled], dtype=np.bool_),
        )

    # -- decode graphs -----------------------------------------------------------------

    def build_graphs(self, *, capture: bool) -> None:
        """Set up the static-buffer decode step; with ``capture``, capture its CUDA graphs.

        Runs on the engine thread at the first step on CUDA (unless ``enforce_eager``).
        ``capture=False`` runs the same static-buffer step eagerly: the CPU tests' switch.
        """
        self._graphs_built = True
        self.graphs = build_decode_graphs(
            self.model,
            self.kv_caches,
            self.backend,
            self.config,
            max_model_len=self.max_model_len,
            scratch_block=self.scratch_block,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
            capture=capture,
        )

    def _ensure_graphs(self) -> None:
        if not self._graphs_built and self.overlaps and not self.config.enforce_eager:
            self._graphs_built = True  # NOTE: once, captured or refused
            if graphs_capturable(self.model, self.device, self.dtype):
                self.build_graphs(capture=True)

    def _close_step_state(self) -> None:
        """Release the decode graphs and any step still in flight."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._in_flight.clear()

    def close(self) -> None:
        """Release the KV cache, the weights, the attention workspaces, the sampling tables
        and the CUDA graphs (when captured), so their device memory returns to the driver
        and their host memory to the system; idempotent.

        A later runner in the same process starts from the same free memory, give or take
        the CUDA libraries' per-thread state (cuBLAS workspaces, loaded kernels).
        """
        if self._closed:
            return
        self._closed = True
        self._close_step_state()
        for name in _RELEASED_ON_CLOSE:
            _close_part(self.__dict__.pop(name, None))
        # NOTE: modules and FlashInfer wrappers can sit in reference cycles; collect them
        # before the allocator's cached blocks go back to the driver, and malloc's free
        # pages to the system.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return_free_heap()


_RELEASED_ON_CLOSE = (
    "kv_caches",
    "model",
    "backend",
    "sampler",
    "batch",
    "_step_sampling",
)
"""Runner attributes dropped by :meth:`ModelRunner.close` (each closed first if it can be);
the decode graphs are released first, by ``_close_step_state``."""


def _close_part(part: object) -> None:
    close = getattr(part, "close", None)
    if callable(close):
        close()


def runner_device(name: str) -> torch.device:
    """The runner's device from the config's name, a CUDA device always with its index:
    ``torch.cuda.set_device`` refuses a bare ``cuda``, which means the current device."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
