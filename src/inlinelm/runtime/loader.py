"""Build everything the engine needs, off the event loop: tokenizer, runner, engine core."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inlinelm.chat_template import read_chat_template
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError, ModelLoadError, RequestError
from inlinelm.reasoning import ReasoningParser, get_reasoning_parser, parser_for_template
from inlinelm.runtime.admission import Admission
from inlinelm.runtime.pooler_config import (
    RERANKER_ANSWERS,
    PoolerConfig,
    read_pooler_config,
    resolve_task,
)
from inlinelm.runtime.prompt_source import render_chat
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.engine_core import EngineCore
from inlinelm.sched.output import EngineCoreOutputs
from inlinelm.sched.runner import Runner
from inlinelm.structured.compiler import GrammarCompiler
from inlinelm.structured.sandbox import TokenizerSource
from inlinelm.tools.template import chat_template_text

if TYPE_CHECKING:
    from inlinelm.gpu.model.encoders.config import EncoderConfig
    from inlinelm.gpu.model_fit import ModelFit

logger = logging.getLogger("inlinelm")

ECHO_DEFAULT_MAX_MODEL_LEN = 8192
ECHO_MAX_BLOCKS = 1 << 16


@dataclass(slots=True)
class LoadedEngine:
    """What ``Engine.start`` produced: the running core and the loop-side helpers."""

    core: EngineCore
    tokenizer: Any
    max_model_len: int
    eos_token_id: int | None
    admission: Admission
    grammars: GrammarCompiler
    # The parser that splits a chat's reasoning from its answer by default (None: none).
    reasoning: ReasoningParser | None = None
    # What the engine serves ("generate", "embed", "score") and, for the last two, how.
    task: str = "generate"
    pooler: PoolerConfig | None = None
    # A pooling request's longest prompt (an encoder takes its whole context; a decoder
    # one token less, where the sample it never uses would go).
    max_pooled_tokens: int = 0
    # A decoder reranker's answer tokens ("yes", "no").
    token_pair: tuple[int, int] | None = None

    def reasoning_end_ids(
        self, parser: ReasoningParser | None, prompt_ids: list[int]
    ) -> tuple[int, ...] | None:
        """The closing tag's token ids when a chat's grammar must wait for the model to end
        its reasoning: a parser is on, and the prompt has not closed the reasoning itself
        (Qwen3's template with ``enable_thinking=false`` renders an empty, closed block)."""
        if parser is None:
            return None
        tail = str(self.tokenizer.decode(prompt_ids[-16:]))
        if tail.rstrip().endswith(parser.end_tag):
            return None
        return tuple(self.tokenizer.encode(parser.end_tag, add_special_tokens=False))

    def make_detokenizer(self, prompt_ids: list[int], params: SamplingParams, stops: Any) -> Any:
        """A fresh incremental detokenizer for one choice.

        ``stops`` is the request's ``inlinelm.detok.StopStrings``, built once and shared by
        its choices (None when it has no stop strings); typed ``Any`` like the detokenizer,
        since the detokenizers load with the engine, not with this module.
        """
        from inlinelm.detok import make_detokenizer

        return make_detokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=() if stops is None else stops,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )


def load_engine(config: EngineConfig, sink: Callable[[EngineCoreOutputs], None]) -> LoadedEngine:
    """Resolve the model, load tokenizer and runner, warm up, start the engine thread.

    What can be checked cheaply is checked before anything slow or large: the config and
    whether the model fits in memory (milliseconds), then the tokenizer, then the weights.
    """
    from inlinelm.gpu.loading.model_files import load_tokenizer, resolve_model

    start = time.perf_counter()
    files = resolve_model(config.model, quantized=_quantized_weights(config))
    encoder = _encoder_config(config, files.folder)
    fit = None if encoder is not None else _check_model_fits(config, files.folder)
    tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else files.folder)
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    if fit is not None:
        _check_vocabulary(len(tokenizer), fit.model_config.vocab_size, files.folder)
    if encoder is not None:
        _check_vocabulary(len(tokenizer), encoder.vocab_size, files.folder)
    hidden = (
        encoder.hidden_size if encoder is not None else fit.model_config.hidden_size if fit else 0
    )
    task, pooler = _pooling_task(config, files.folder, encoder, hidden)
    logger.info("tokenizer loaded in %.2f s", time.perf_counter() - start)
    eos = tokenizer.eos_token_id
    defaults = config.sampling_defaults(files.generation)
    completion_defaults = config.sampling_defaults(files.generation, chat=False)
    logger.info(
        "sampling defaults for unset request fields: %s (a completion's max_tokens: %s)",
        defaults,
        completion_defaults["max_tokens"],
    )
    if encoder is not None:
        runner, max_model_len, vocab_size, overlaps = _build_encoder_runner(
            config, files.folder, encoder
        )
    else:
        runner, max_model_len, vocab_size, overlaps = _build_runner(config, files.folder, eos, fit)
    # NOTE: a runner that computes on the engine thread (the CPU model) gains nothing from
    # the pipelined loop, so it keeps the plain one.
    core_config = config.with_options(
        max_model_len=max_model_len, async_scheduling=config.async_scheduling and overlaps
    )
    if encoder is not None:
        core_config = _encoder_scheduling(core_config, max_model_len)
    core = EngineCore(core_config, runner, eos, sink)
    core.start()
    logger.info(
        "engine ready in %.2f s: model %s on %s (%s runner), max_model_len %d, "
        "%d KV blocks of %d tokens",
        time.perf_counter() - start,
        config.model,
        config.device,
        config.runner,
        max_model_len,
        runner.num_kv_blocks,
        config.block_size,
    )
    admission = Admission(tokenizer, vocab_size, max_model_len, defaults, completion_defaults)
    grammars = GrammarCompiler(
        lambda: TokenizerSource.from_hf(tokenizer),
        num_slots=config.grammar_compile_threads,
        timeout_s=config.grammar_compile_timeout_s,
        cache_size=config.grammar_cache_size,
        cache_bytes=config.grammar_cache_bytes,
    )
    reasoning = chat_reasoning_parser(config, tokenizer) if task == "generate" else None
    max_pooled = max_model_len if encoder is not None else max_model_len - 1
    if pooler is not None and pooler.max_input_tokens is not None:
        max_pooled = min(max_pooled, pooler.max_input_tokens)
    token_pair = None
    if task == "score" and encoder is None:
        token_pair = _answer_tokens(tokenizer, files.folder)
    return LoadedEngine(
        core,
        tokenizer,
        max_model_len,
        eos,
        admission,
        grammars,
        reasoning,
        task,
        pooler,
        max_pooled,
        token_pair,
    )


def _encoder_config(config: EngineConfig, folder: Path) -> EncoderConfig | None:
    """The folder's encoder config when it holds an encoder (BERT, XLM-RoBERTa,
    ModernBERT), else None (a decoder, or the echo runner)."""
    if config.runner == "echo":
        return None
    from inlinelm.gpu.model.encoders.config import is_encoder_config, read_encoder_config

    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # NOTE: the decoder path reads it again and names the fault
    if not isinstance(raw, dict) or not is_encoder_config(raw):
        return None
    check_device(config.device)
    return read_encoder_config(folder)


def _pooling_task(
    config: EngineConfig, folder: Path, encoder: EncoderConfig | None, hidden_size: int
) -> tuple[str, PoolerConfig | None]:
    """The task served and, for a pooling one, its pooling."""
    if config.runner == "echo":
        if config.task not in ("auto", "generate"):
            raise ConfigError("the echo runner serves task='generate' only", option="task")
        return "generate", None
    classifier = encoder is not None and encoder.classifier
    task = resolve_task(config, folder, encoder=encoder is not None, classifier=classifier)
    labels = encoder.num_labels if encoder is not None else 1
    pooler = read_pooler_config(
        config,
        folder,
        task,
        encoder=encoder is not None,
        hidden_size=hidden_size,
        num_labels=labels,
    )
    return task, pooler


def _encoder_scheduling(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """The scheduling of an encoder: every prompt whole in one step (attention reads
    every token), no prefix cache (nothing is kept), room for a full-length prompt (the
    scheduler's length bounds a generator's prompt plus one token)."""
    return config.with_options(
        max_model_len=max_model_len + 1,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(config.max_num_batched_tokens, max_model_len + 1),
    )


def _answer_tokens(tokenizer: Any, folder: Path) -> tuple[int, int]:
    """A decoder reranker's "yes" and "no" token ids; each must be one token."""
    ids = []
    for answer in RERANKER_ANSWERS:
        encoded = tokenizer.encode(answer, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(
                f"task='score' on a decoder scores its answer {answer!r}, which the tokenizer "
                f"of {folder} splits into {len(encoded)} tokens",
                option="task",
            )
        ids.append(encoded[0])
    return ids[0], ids[1]


def _build_encoder_runner(
    config: EngineConfig, folder: Path, encoder: EncoderConfig
) -> tuple[Runner, int, int, bool]:
    """An encoder's runner, its context length and vocabulary size (never pipelined)."""
    from inlinelm.gpu.encoder_runner import EncoderRunner

    runner = EncoderRunner(config, folder, encoder)
    runner.warmup()
    return runner, runner.max_model_len, encoder.vocab_size, False


def chat_reasoning_parser(config: EngineConfig, tokenizer: Any) -> ReasoningParser | None:
    """The ``reasoning_parser`` option resolved: ``"auto"`` is the one the chat
    template's family takes (judged by its text and its generation prompt, rendered with
    the default template variables), ``"none"`` none."""
    if config.reasoning_parser == "none":
        return None
    if config.reasoning_parser != "auto":
        return get_reasoning_parser(config.reasoning_parser)
    template = chat_template_text(tokenizer)
    prompt = ""
    if "<think>" in template:
        # NOTE: a template that cannot render here fails each chat later, as a 400
        try:
            prompt = render_chat(
                tokenizer,
                [{"role": "user", "content": "?"}],
                None,
                config.default_chat_template_kwargs,
            )
        except RequestError:
            prompt = ""
    return parser_for_template(template, prompt)


def _quantized_weights(config: EngineConfig) -> bool:
    """Whether the runner may compute with block-quantized weights (then a GGUF file's
    conversion keeps its quantized matrices as blocks): a model runner on a CPU whose
    kernel built."""
    if config.runner == "echo" or config.weight_quantization == "none":
        return False
    from inlinelm.gpu.model.cpu_extension import cpu_extension

    return cpu_extension() is not None


def _check_model_fits(config: EngineConfig, folder: Path) -> ModelFit | None:
    """What ``check_model_fits`` found once the model is known to fit: its config, the
    ``max_model_len`` served (resolved here, once: the runner and the scheduler take it as
    given) and the KV cache's spec when fixed up front; None for the echo runner, which
    loads no weights (:func:`_build_echo_runner` resolves its length)."""
    if config.runner == "echo":
        return None
    from inlinelm.gpu.model_fit import check_model_fits

    check_device(config.device)
    return check_model_fits(config, folder)


def _check_vocabulary(num_tokens: int, vocab_size: int, folder: Path) -> None:
    """Refuse a tokenizer with ids past the model's embedding (a prompt could hold them,
    and the engine thread indexes the embedding unchecked)."""
    if num_tokens > vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {num_tokens} tokens but the model's vocab_size is {vocab_size}: "
            f"ids from {vocab_size} on have no embedding row",
            path=str(folder / "config.json"),
            field="vocab_size",
        )


def _build_runner(
    config: EngineConfig, folder: Path, eos: int | None, fit: ModelFit | None
) -> tuple[Runner, int, int, bool]:
    """The runner, the context length, the vocabulary size, and whether the device
    computes while the engine thread schedules (the pipelined loop pays off); ``fit`` is
    :func:`_check_model_fits`'s (None for the echo runner)."""
    if config.runner == "echo":
        return (*_build_echo_runner(config, folder, eos), True)
    from inlinelm.gpu.model_runner import ModelRunner

    check_device(config.device)
    runner = ModelRunner(config, folder, fit)
    runner.warmup()
    return runner, runner.max_model_len, runner.model_config.vocab_size, runner.overlaps


def check_device(device: str) -> None:
    """Refuse a CUDA device this torch cannot use, naming the devices it can."""
    import torch

    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = ", ".join(["cpu", *(f"cuda:{i}" for i in range(count))])
    if count == 0:
        build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(
            f"device={device!r}, but torch {torch.__version__} cannot use CUDA here ({build}); "
            f"available: {available}",
            option="device",
        )
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ConfigError(
            f"device={device!r}, but only {count} CUDA device(s) are visible; available: {available}",
            option="device",
        )


def _build_echo_runner(
    config: EngineConfig, folder: Path, eos: int | None
) -> tuple[Runner, int, int]:
    """The echo runner, its context length (the option, else the model's
    ``max_position_embeddings`` when a config.json is there, else a default: resolved once,
    here) and its vocabulary size."""
    from inlinelm.gpu.echo_runner import EchoRunner
    from inlinelm.gpu.model.registry import read_model_config

    max_len, vocab = ECHO_DEFAULT_MAX_MODEL_LEN, 1 << 20
    if (folder / "config.json").is_file():
        model_config = read_model_config(folder)
        max_len, vocab = model_config.max_position_embeddings, model_config.vocab_size
    max_len = config.max_model_len or max_len
    blocks = config.num_kv_blocks or min(
        config.max_num_seqs * -(-max_len // config.block_size), ECHO_MAX_BLOCKS
    )
    return EchoRunner(config, blocks, eos), max_len, vocab
