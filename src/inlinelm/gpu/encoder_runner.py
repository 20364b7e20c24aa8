"""The runner of an encoder model (BERT, XLM-RoBERTa, ModernBERT): pooling requests only
(engine thread).

An encoder attends both ways, so a prompt is computed whole, in one step, and nothing is
kept after it: there is no KV cache. The scheduler still admits and batches the requests
(its block pool is bookkeeping here, sized so that ``max_num_seqs`` full prompts always
fit); the engine schedules them unchunked, a step's prompts one ragged batch.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import torch

from inlinelm.config import EngineConfig
from inlinelm.gpu.cpu_threads import CpuThreads
from inlinelm.gpu.model.encoders.config import EncoderConfig
from inlinelm.gpu.model.encoders.loading import load_encoder
from inlinelm.gpu.model_fit import DTYPES
from inlinelm.gpu.model_memory import return_free_heap
from inlinelm.gpu.model_runner import runner_device
from inlinelm.gpu.pooling import class_scores, embeddings, pool_rows
from inlinelm.sched.output import ScheduledRequest, SchedulerOutput
from inlinelm.sched.pooling import Pooling
from inlinelm.sched.runner import ModelRunnerOutput


class EncoderRunner:
    """Loads an encoder and turns each step's prompts into their pooled results."""

    long_context_from: int | None = None

    def __init__(self, config: EngineConfig, folder: Path, model_config: EncoderConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = runner_device(config.device)
        self.dtype = DTYPES[config.model_dtype]
        self.cpu_threads = CpuThreads(config.num_threads) if self.device.type == "cpu" else None
        self.max_model_len = min(
            config.max_model_len or model_config.max_model_len, model_config.max_model_len
        )
        # NOTE: bookkeeping blocks only: every running request holds its whole prompt.
        per_request = -(-(self.max_model_len + 1) // config.block_size)
        self.num_kv_blocks = config.max_num_seqs * per_request
        self.model = load_encoder(folder, model_config, self.dtype, self.device)
        self._current_threads = 0
        self._prepared_thread: int | None = None
        return_free_heap()

    def start_on_thread(self) -> None:
        """Make the runner's device current on the engine thread (CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One short forward, so the first request does not pay for lazy set-up."""
        self._prepare_thread()
        ids = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.model(ids, None, [3, 1])

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the step's prompts (each whole) and pool each one."""
        self._prepare_thread()
        items = batch.scheduled
        if not items:
            return ModelRunnerOutput([], [])
        assert all(item.start == 0 and item.samples for item in items), "prompts come whole"
        hidden, seq_lens = self._forward(items)
        poolings = [_pooling(item) for item in items]
        results: list[list[float]] = [[] for _ in items]
        embeds = [i for i, p in enumerate(poolings) if p.head == "embed"]
        if embeds:
            pooled = pool_rows(hidden, seq_lens, [p.method for p in poolings])
            vectors = embeddings(pooled[embeds], [poolings[i] for i in embeds])
            for i, vector in zip(embeds, vectors, strict=True):
                results[i] = vector
        classified = [i for i, p in enumerate(poolings) if p.head == "classify"]
        if classified:
            logits = self.model.classify(hidden, seq_lens)
            scores = class_scores(logits[classified], [poolings[i] for i in classified])
            for i, score in zip(classified, scores, strict=True):
                results[i] = score
        pooled_by_id = {item.request.request_id: r for item, r in zip(items, results, strict=True)}
        return ModelRunnerOutput([], [], pooled=pooled_by_id)

    def _forward(self, items: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """The last hidden states of the step's prompts, one after another."""
        seq_lens = [item.request.num_prompt_tokens for item in items]
        ids = [t for item in items for t in item.request.prompt_token_ids]
        types = None
        if any(_pooling(item).token_type_ids for item in items):
            types = [
                t
                for item in items
                for t in (_pooling(item).token_type_ids or (0,) * item.request.num_prompt_tokens)
            ]
        if self.cpu_threads is not None:
            wanted = self.cpu_threads.current()
            if wanted != self._current_threads:
                torch.set_num_threads(wanted)
                self._current_threads = wanted
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        token_types = (
            None if types is None else torch.tensor(types, dtype=torch.int64, device=self.device)
        )
        hidden: torch.Tensor = self.model(input_ids, token_types, seq_lens)
        return hidden, seq_lens

    def _prepare_thread(self) -> None:
        """Flush denormals on the thread that computes (see ModelRunner._prepare_thread)."""
        if self._prepared_thread == threading.get_ident():
            return
        self._prepared_thread = threading.get_ident()
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)

    def close(self) -> None:
        """Release the weights (idempotent)."""
        if self.__dict__.pop("model", None) is None:
            return
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return_free_heap()


def _pooling(item: ScheduledRequest) -> Pooling:
    pooling = item.request.pooling
    assert pooling is not None, "an encoder serves pooling requests only"
    return pooling
