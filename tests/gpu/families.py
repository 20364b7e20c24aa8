"""A tiny config of every model family we run, for the family tests and the GGUF tests.

Each is small (a few layers, hidden 64) but keeps what makes its family differ: windows
shorter than the test prompts, four experts with top-2 routing, an explicit head dim
that is not hidden / heads, partial rotary, long-RoPE factors whose original length the
decode crosses. :func:`make_family_model` has transformers build the model with random
weights and save it beside the default model's tokenizer (nothing is downloaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import make_tiny_model

WINDOW = 8
"""The sliding window of the tiny windowed families: shorter than every test prompt but
the shortest, so the window cuts into the prefill and into every decode."""

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "sliding_window": WINDOW},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "mixtral": {
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "sliding_window": WINDOW,
    },
    "gemma2": {
        "model_type": "gemma2",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 0.05,
        "final_logit_softcapping": 0.5,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    },
    "phi3": {
        "model_type": "phi3",
        "partial_rotary_factor": 0.5,
        # NOTE: the test prompts (1, 5, 17, 18 and 34 tokens) with their 16 tokens: two stay
        # below it, two cross it while decoding (where transformers' Phi-3 drops its KV
        # cache and encodes the whole sequence again with the long factors:
        # Phi3ForCausalLM.prepare_inputs_for_generation; we recompute it so), and one is
        # past it from its first token.
        "original_max_position_embeddings": 20,
        "max_position_embeddings": 256,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.5, 2.0, 3.0, 4.5],
        },
        "pad_token_id": 0,
    },
    "olmo2": {"model_type": "olmo2"},
    "granite": {
        "model_type": "granite",
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625,
        "logits_scaling": 8.0,
    },
    "smollm3": {
        "model_type": "smollm3",
        "num_hidden_layers": 4,
        "no_rope_layer_interval": 2,
        "pad_token_id": 0,
    },
}
"""Overrides of :func:`~tests.conftest.make_tiny_model`'s tiny Llama, by family."""


def make_family_model(folder: Path, tokenizer_dir: Path, family: str) -> Path:
    """The tiny model of ``family`` (a key of :data:`FAMILY_CONFIGS`) saved in ``folder``."""
    return make_tiny_model(folder, tokenizer_dir, **FAMILY_CONFIGS[family])
