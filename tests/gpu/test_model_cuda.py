"""The model runner on its device: kernel and backend choice, memory given back on close,
and (on CUDA) FlashInfer and torch logits against the CPU float32 model."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from inlinelm import Engine, SamplingParams
from inlinelm.config import EngineConfig
from inlinelm.gpu.attention.metadata import AttentionMetadata
from inlinelm.gpu.attention.torch_backend import TorchAttention
from inlinelm.gpu.model.kernels import TorchKernels
from inlinelm.gpu.model_runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.gpu.reference import PROMPTS, load_ours, prefill_logits

MiB = 2**20


@pytest.fixture(scope="module")
def head64_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random Llama with head_dim 64 (FlashInfer's kernels take 64, 128, 256)."""
    folder = tmp_path_factory.mktemp("head64")
    return make_tiny_model(
        folder,
        tokenizer_dir,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_a_cpu_runner_is_float32_with_torch_kernels_and_attention(tiny_model_dir: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8), tiny_model_dir)
    assert runner.dtype == torch.float32 and runner.kernels_kind == "torch"
    assert isinstance(runner.model.kernels, TorchKernels)
    assert isinstance(runner.backend, TorchAttention)
    assert runner.model.layers[0].self_attn.backend is runner.backend
    runner.close()


def test_close_drops_the_model_and_cache_and_is_idempotent(tiny_model_dir: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8), tiny_model_dir)
    runner.warmup()
    runner.close()
    runner.close()
    for name in ("model", "kv_caches", "backend", "sampler", "batch"):
        assert not hasattr(runner, name), name


# -- on the device --------------------------------------------------------------------------


def _device_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of every position: a prefill of all but the last token, then one decode."""
    return torch.cat([_step(runner, ids[:-1], 0), _step(runner, ids, len(ids) - 1)])


def _step(runner: ModelRunner, ids: list[int], start: int) -> torch.Tensor:
    device, block_size = runner.device, runner.config.block_size
    total, new = len(ids), len(ids) - start
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, total, device=device),
        query_start_loc=torch.tensor([0, new], device=device),
        seq_lens=torch.tensor([total], device=device),
        block_tables=torch.arange(-(-total // block_size), device=device)[None],
        max_query_len=new,
        max_seq_len=total,
    )
    runner.backend.prepare(meta, block_size)
    with torch.inference_mode():
        logits = runner.model(
            torch.tensor(ids[start:], device=device),
            torch.arange(start, total, device=device),
            runner.kv_caches,
            meta,
            torch.arange(new, device=device),
        )
    return logits.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_cuda_logits_equal_the_cpu_model(
    backend: str, head64_model_dir: Path, tokenizer: Any
) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    config = EngineConfig(
        model=str(head64_model_dir), device="cuda", attention_backend=backend, num_kv_blocks=64
    )
    runner = ModelRunner(config, head64_model_dir)
    assert runner.dtype == torch.bfloat16 and runner.kernels_kind == backend
    reference = load_ours(head64_model_dir)
    try:
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            if len(ids) < 2:
                continue
            expected = prefill_logits(reference, ids)
            torch.testing.assert_close(_device_logits(runner, ids), expected, rtol=5e-2, atol=5e-2)
    finally:
        runner.close()


def _memory() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
def test_close_returns_gpu_memory_and_a_second_runner_starts(head64_model_dir: Path) -> None:
    config = EngineConfig(
        model=str(head64_model_dir),
        device="cuda",
        gpu_memory_utilization=0.05,
        max_num_batched_tokens=512,
        max_num_seqs=16,
    )
    # The first runner leaves this thread's CUDA library state (cuBLAS workspaces, loaded
    # kernels) behind; every later one must give back all it took.
    ModelRunner(config, head64_model_dir).close()
    allocated, free = _memory()
    for _ in range(2):
        runner = ModelRunner(config, head64_model_dir)
        runner.warmup()
        assert runner.num_kv_blocks > 2
        kv_bytes = runner.num_kv_blocks * runner.kv_spec.bytes_per_block
        assert torch.cuda.memory_allocated() >= allocated + kv_bytes
        runner.close()
        now_allocated, now_free = _memory()
        assert now_allocated <= allocated
        assert abs(now_free - free) <= 8 * MiB


@pytest.mark.gpu
def test_a_second_engine_starts_and_generates_after_the_first_closes(
    head64_model_dir: Path,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = []
    for _ in range(2):
        engine = Engine(model=str(head64_model_dir), device="cuda", gpu_memory_utilization=0.05)
        try:
            engine.start_sync()
            outputs.append(engine.generate(["Hello there"], params, use_tqdm=False)[0])
        finally:
            engine.close()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
