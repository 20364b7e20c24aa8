"""Build everything the engine needs, off the event loop: tokenizer, runner, engine core."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inlinelm.config import EngineConfig
from inlinelm.errors import RequestError
from inlinelm.runtime.engine_core import EngineCore
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.output import EngineCoreOutputs, Runner

logger = logging.getLogger("inlinelm")

ECHO_DEFAULT_MAX_MODEL_LEN = 8192
ECHO_MAX_BLOCKS = 1 << 16


@dataclass(slots=True)
class Admission:
    """Tokenizes prompts and checks them against the context before anything is queued."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int

    def tokenize(
        self, prompt: str | list[int], add_special_tokens: bool, param: str = "prompt"
    ) -> list[int]:
        """Token ids of ``prompt``; raises ``RequestError`` for an empty or invalid prompt."""
        if isinstance(prompt, str):
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = prompt
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise RequestError(
                    f"prompt token ids must be in [0, {self.vocab_size})", param=param
                )
        else:
            raise RequestError("prompt must be a string or a list of token ids", param=param)
        if not ids:
            raise RequestError("the prompt is empty", param=param)
        return ids

    def check_lengths(
        self, prompt_ids: list[int], params: SamplingParams, param: str = "prompt"
    ) -> int:
        """The effective max_tokens; raises ``RequestError`` when prompt + output cannot fit."""
        from inlinelm.gpu.sampling_metadata import check_token_ids

        check_token_ids([params], self.vocab_size)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens",
                param=param,
            )
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion)",
                param="max_tokens",
            )
        return params.max_tokens if params.max_tokens is not None else room


@dataclass(slots=True)
class LoadedEngine:
    """What ``Engine.start`` produced: the running core and the loop-side helpers."""

    core: EngineCore
    tokenizer: Any
    max_model_len: int
    eos_token_id: int | None
    admission: Admission

    def make_detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        """A fresh incremental detokenizer for one choice."""
        from inlinelm.detok import make_detokenizer

        return make_detokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )


def load_engine(config: EngineConfig, sink: Callable[[EngineCoreOutputs], None]) -> LoadedEngine:
    """Resolve the model, load tokenizer and runner, warm up, start the engine thread."""
    from transformers import AutoTokenizer

    from inlinelm.gpu.model_files import resolve_model

    start = time.perf_counter()
    files = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(
        str(Path(config.tokenizer) if config.tokenizer else files.folder)
    )
    logger.info("tokenizer loaded in %.2f s", time.perf_counter() - start)
    eos = tokenizer.eos_token_id
    runner, max_model_len, vocab_size = _build_runner(config, files.folder, eos)
    core = EngineCore(config.with_options(max_model_len=max_model_len), runner, eos, sink)
    core.start()
    logger.info(
        "engine ready in %.2f s: %s runner, max_model_len %d, %d KV blocks of %d tokens",
        time.perf_counter() - start,
        config.runner,
        max_model_len,
        runner.num_kv_blocks,
        config.block_size,
    )
    return LoadedEngine(
        core, tokenizer, max_model_len, eos, Admission(tokenizer, vocab_size, max_model_len)
    )


def _build_runner(config: EngineConfig, folder: Path, eos: int | None) -> tuple[Runner, int, int]:
    if config.runner == "echo":
        return _build_echo_runner(config, folder, eos)
    from inlinelm.gpu.model_runner import ModelRunner

    runner = ModelRunner(config, folder)
    runner.warmup()
    return runner, runner.max_model_len, runner.model_config.vocab_size


def _build_echo_runner(
    config: EngineConfig, folder: Path, eos: int | None
) -> tuple[Runner, int, int]:
    from inlinelm.gpu.echo_runner import EchoRunner
    from inlinelm.gpu.model_config import ModelConfig

    max_len, vocab = ECHO_DEFAULT_MAX_MODEL_LEN, 1 << 20
    if (folder / "config.json").is_file():
        model_config = ModelConfig.from_folder(folder)
        max_len, vocab = model_config.max_position_embeddings, model_config.vocab_size
    max_len = config.max_model_len or max_len
    blocks = config.num_kv_blocks or min(
        config.max_num_seqs * -(-max_len // config.block_size), ECHO_MAX_BLOCKS
    )
    return EchoRunner(config, blocks, eos), max_len, vocab
