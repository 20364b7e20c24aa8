"""Shared pieces of the GPU benchmarks: model shapes, random weights, engine options, timers.

No weights travel to the device (the default model's GGUF is 98 MB, the call carries 64 MiB):
the SmolLM2 shape comes from ``benchmarks/gpu_assets`` (config and tokenizer of the default
model), the Llama-3-8B shape is written out below, and the weights are random.

Off CUDA, ``--rehearsal`` runs a benchmark on the CPU at tiny shapes through the same code
(``benchmarks/gpu_check.sh`` does, so a CPU machine proves imports, paths and plumbing).
What only a CUDA device has sits behind one small function each: :func:`event` (timing),
:func:`synchronize`, :func:`empty_cache`, :func:`device_name`, :func:`copy_bandwidth`, and
:func:`runner_as_on_cuda` (the runner's pipelined loop and static-buffer decode, uncaptured).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
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


def add_rehearsal_argument(parser: Any) -> None:
    """``--rehearsal``: without CUDA, run on the CPU at tiny shapes instead of skipping."""
    parser.add_argument(
        "--rehearsal",
        action="store_true",
        help="without a CUDA device, run on the CPU at tiny shapes (numbers mean nothing)",
    )


def pick_device(rehearsal: bool, json_path: str | None, name: str) -> str:
    """``"cuda"`` when there is a device; ``"cpu"`` for a rehearsal; else write a
    'skipped: no CUDA' record and exit with ``SKIPPED_EXIT``."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if rehearsal:
        print(f"{name}: CPU rehearsal at tiny shapes (no CUDA device)")
        return "cpu"
    print(f"{name}: skipped: no CUDA")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"status": "skipped", "reason": "no CUDA"}))
    sys.exit(SKIPPED_EXIT)


def tiny_shape(config: dict[str, Any], kv_heads: int) -> dict[str, Any]:
    """``config`` shrunk for a CPU rehearsal: 2 layers, hidden 64, 4 query heads of 16 and
    ``kv_heads`` KV heads, the real tokenizer's 49,152 tokens; RoPE and tied head kept."""
    tiny = dict(config)
    tiny.update(
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
    )
    return tiny


def model_dtype(device: str) -> str:
    """bf16 on CUDA (what is measured); float32 for a CPU rehearsal (the CPU's fast path)."""
    return "bfloat16" if device == "cuda" else "float32"


class HostEvent:
    """A CPU stand-in for ``torch.cuda.Event(enable_timing=True)``: the host clock at
    ``record``; a rehearsal's device is the host, so the two agree."""

    def __init__(self) -> None:
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.time is not None and end.time is not None
        return (end.time - self.time) * 1e3


def event(device: str) -> Any:
    """A timing event on ``device``'s current stream (``record``, ``synchronize``,
    ``elapsed_time`` in ms)."""
    import torch

    if device == "cuda":
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch stub
    return HostEvent()


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def empty_cache(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name())
    return f"cpu (rehearsal, {os.cpu_count()} cores)"


@contextlib.contextmanager
def runner_as_on_cuda(device: str) -> Iterator[None]:
    """On a CPU, make ``ModelRunner`` take the paths it takes on CUDA: the pipelined engine
    loop (``overlaps``) and the static-buffer decode step, built at the first step and run
    uncaptured (``build_graphs(capture=False)``, the CPU tests' switch). No-op on CUDA."""
    if device == "cuda":
        yield
        return
    from inlinelm.gpu.model_runner import ModelRunner

    overlaps, build_graphs = ModelRunner.__dict__["overlaps"], ModelRunner.build_graphs

    def uncaptured(self: ModelRunner, *, capture: bool) -> None:
        build_graphs(self, capture=False)

    # NOTE: class attributes, restored on exit: the engine builds its runner on a loader
    # thread and replays on the engine thread, both inside this block.
    ModelRunner.overlaps = property(lambda self: True)  # type: ignore[assignment,method-assign]  # a rehearsal's stand-in
    ModelRunner.build_graphs = uncaptured  # type: ignore[method-assign]  # same call shape
    try:
        yield
    finally:
        ModelRunner.overlaps = overlaps  # type: ignore[method-assign]  # restored
        ModelRunner.build_graphs = build_graphs  # type: ignore[method-assign]  # restored


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
    """Make ``inlinelm.gpu.loading.weights.load_model`` fill the model with random values on its
    device instead of reading safetensors (an 8B model's 16 GB need no file).

    Every parameter of the built model gets N(0, std), norm weights 1; the rest of
    ``load_model`` (RoPE tables, tied heads, packing) runs as usual.
    """
    import torch

    from inlinelm.gpu.loading import weights

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
    """The model runner as ``Engine.start`` builds it (load, warm-up; graphs at its first
    step, under :func:`runner_as_on_cuda` on a CPU)."""
    from inlinelm.runtime import loader

    fit = loader._check_model_fits(config, folder)
    runner, _max_model_len, _vocab_size, _overlaps = loader._build_runner(config, folder, None, fit)
    return runner


def copy_bandwidth(device: str, num_bytes: int = 4 << 30, repeats: int = 10) -> float:
    """Copy bandwidth on ``device`` in bytes/s, counting bytes read and written (a CPU
    rehearsal copies 64 MiB of host memory)."""
    import torch

    if device != "cuda":
        num_bytes, repeats = min(num_bytes, 64 << 20), min(repeats, 3)
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = event(device), event(device)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    empty_cache(device)
    return float(num_bytes / seconds)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
