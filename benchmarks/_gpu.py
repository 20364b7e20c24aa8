"""Shared pieces of the GPU benchmarks: model shapes, random weights, engine options, timers.

No weights travel to the device (the default model's GGUF is 98 MB, the call carries 64 MiB):
the SmolLM2 shape comes from ``benchmarks/gpu_assets`` (config and tokenizer of the default
model), the Llama-3-8B shape is written out below, and the weights are random.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "gpu_assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SKIPPED_EXIT = 3
"""Exit status of a GPU benchmark that found no CUDA device (it wrote a 'skipped' record)."""

LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def smollm2_config() -> dict[str, Any]:
    """The default model's config.json (SmolLM2-135M-Instruct: 30 layers, hidden 576)."""
    config: dict[str, Any] = json.loads((ASSETS / "config.json").read_text())
    return config


def exit_if_no_cuda(json_path: str | None, name: str) -> None:
    """Write a 'skipped: no CUDA' record and exit with ``SKIPPED_EXIT`` when CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    print(f"{name}: skipped: no CUDA")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"status": "skipped", "reason": "no CUDA"}))
    sys.exit(SKIPPED_EXIT)


def write_config_folder(folder: Path, config: dict[str, Any]) -> Path:
    """A model folder with config.json and the tokenizer files, no weights (see random_weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS / name, folder / name)
    return folder


def write_random_model(folder: Path, config: dict[str, Any], dtype: Any, seed: int = 0) -> Path:
    """A Hugging Face folder (safetensors, config, tokenizer) of a random-initialised model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    options = dict(config)
    options.pop("_model_name_or_path", None)
    hf_config = AutoConfig.for_model(options.pop("model_type"), **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(str(folder))
    del model
    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS / name, folder / name)
    return folder


@contextlib.contextmanager
def random_weights(std: float = 0.02, seed: int = 0) -> Iterator[None]:
    """Make ``inlinelm.gpu.weights.load_model`` fill the model with random values on its
    device instead of reading safetensors (an 8B model's 16 GB need no file).

    Every parameter of the built model gets N(0, std), norm weights 1; the rest of
    ``load_model`` (RoPE tables, tied heads, packing) runs as usual.
    """
    import torch

    from inlinelm.gpu import weights

    def fill(folder: Path, cfg: Any, params: dict[str, torch.Tensor]) -> set[Any]:
        generator = torch.Generator(next(iter(params.values())).device).manual_seed(seed)
        for name, tensor in params.items():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith("bias"):
                tensor.zero_()
            else:
                tensor.normal_(0.0, std, generator=generator)
        return set()

    saved = weights._load_files, weights._check_complete
    weights._load_files = fill  # type: ignore[assignment]  # same call shape, random values
    weights._check_complete = lambda *args: None  # type: ignore[assignment]  # nothing is read
    try:
        yield
    finally:
        weights._load_files, weights._check_complete = saved


def engine_config(**options: Any) -> Any:
    """``EngineConfig`` with ``options``; an option this build does not know raises
    ``RequestError`` ("unknown engine option 'x'"), which the callers report per row."""
    from inlinelm.config import EngineConfig

    return EngineConfig().with_options(**options)


def build_runner(config: Any, folder: Path) -> Any:
    """The model runner exactly as ``Engine.start`` builds it (load, warm-up, graph capture)."""
    from inlinelm.runtime import loader

    runner, _, _ = loader._build_runner(config, folder, None)
    return runner


def copy_bandwidth(num_bytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    torch.cuda.empty_cache()
    return num_bytes / seconds


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
