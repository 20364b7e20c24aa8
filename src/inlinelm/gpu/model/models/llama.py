"""Llama, Mistral and Qwen2 (and SmolLM2, a Llama): the base decoder as it is."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.family import Family


def _qwen2(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """Qwen2's Q/K/V projections always have a bias, its output projection never."""
    return replace(cfg, attention_bias=True, attention_out_bias=False)


LLAMA = Family(
    name="Llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    examples=("meta-llama/Llama-3.2-1B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    gguf="llama",
)
MISTRAL = Family(
    name="Mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    examples=("mistralai/Mistral-7B-Instruct-v0.3",),
    gguf="llama",
    model_wide_window=True,
)
QWEN2 = Family(
    name="Qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    examples=("Qwen/Qwen2.5-0.5B-Instruct",),
    gguf="qwen2",
    configure=_qwen2,
)
