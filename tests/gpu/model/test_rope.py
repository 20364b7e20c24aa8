"""The RoPE table of every type against transformers 5.24's own rotary embedding modules,
built from the same config.json dict; and the errors a bad RoPE config gets.

Tolerance. Both sides compute in float32 with the same operations, and on a CPU they agree
bit for bit today; the bound below is what float32 lets us promise where a kernel rounds
differently (another CPU's vector pow or cos, a GPU). If the inverse frequencies agree to
an ulp (relative 2u, u = 2^-24), the angles ``fl(p * f)`` differ by at most ``4u|θ|``
(that ulp plus the rounding of each product); cos and sin are 1-Lipschitz and each is
within an ulp of its value (2u below 1); the attention factor ``a`` scales it all. So
``|Δ| <= a * u * (4|θ| + 4)``, with ``θ`` the reference's own angle. A flat tolerance would
be wrong both ways: the angle reaches 1e5 rad at the far rows, where one ulp of frequency
moves cos by ~1e-2, while near position 0 the bound is a few 1e-7, so a wrong formula fails.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from inlinelm.errors import ModelLoadError
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.rope import (
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
    check_rotary_dim,
    cos_sin_cache,
    parse_rope,
)

U = 2.0**-24
NUM_POSITIONS = 1 << 16
LLAMA = {
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
SHORT = tuple(1.0 + 0.01 * i for i in range(16))
LONG = tuple(1.0 + 1.3 * i for i in range(16))
PHI3 = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "short_factor": list(SHORT), "long_factor": list(LONG)},
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    # transformers warns (through logging) about some of the odd configs we build on purpose.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def ours(raw: dict[str, Any], rotary_dim: int, num_positions: int = NUM_POSITIONS) -> torch.Tensor:
    return cos_sin_cache(parse_rope(ConfigFields(raw, "config.json")), rotary_dim, num_positions)


def reference(module: torch.nn.Module, positions: torch.Tensor, **kwargs: str) -> torch.Tensor:
    """transformers' [n, 2 * dim/2] cos then sin for one forward over ``positions`` (its
    halves are duplicated: the first is ours), and the angles [n, dim/2] in float64."""
    cos, sin = module(torch.zeros(1), positions[None], **kwargs)
    half = cos.shape[-1] // 2
    inv_freq = getattr(module, f"{kwargs['layer_type']}_inv_freq" if kwargs else "inv_freq")
    angles = positions.double()[:, None] * inv_freq.double()
    return torch.cat((cos[0, :, :half], sin[0, :, :half], angles), dim=-1)


def assert_close(table: torch.Tensor, expected: torch.Tensor, attention: float = 1.0) -> None:
    """``table`` rows against :func:`reference` rows, within the module docstring's bound."""
    half = table.shape[-1] // 2
    angles = expected[:, 2 * half :].abs().repeat(1, 2)
    bound = attention * U * (4 * angles + 4)
    error = (table.double() - expected[:, : 2 * half].double()).abs()
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"error reaches {worst:.2f} times the bound"


def decoded_rows(module: torch.nn.Module, positions: list[int]) -> torch.Tensor:
    """transformers' rows for tokens decoded alone, in increasing position, as decoding runs."""
    return torch.cat([reference(module, torch.tensor([p])) for p in positions])


def spread(original: int, num_positions: int = NUM_POSITIONS) -> list[int]:
    """Positions around and well past ``original``: where dynamic and longrope switch."""
    edges = [0, 1, original - 2, original - 1, original, original + 1, 2 * original]
    far = torch.linspace(original + 2, num_positions - 1, 24).long().tolist()
    return sorted(set(edges + far + [num_positions - 1]))


STATIC_CASES = {
    "default": {},
    "linear (old `type` key)": {"rope_scaling": {"type": "linear", "factor": 4.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    },
    "yarn": {"rope_parameters": {**YARN, "rope_theta": 1e6}},
    "yarn, factor from the lengths": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": None,
            "original_max_position_embeddings": 1024,
        }
    },
    "yarn, mscale = mscale_all_dim (DeepSeek-V2)": {
        "rope_parameters": {**YARN, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707}
    },
    "yarn, mscale / mscale_all_dim, no truncation, betas": {
        "rope_parameters": {
            **YARN,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "truncate": False,
            "beta_fast": 16,
            "beta_slow": 2,
        }
    },
    "yarn, attention_factor": {"rope_parameters": {**YARN, "attention_factor": 0.9}},
    "yarn, the ramp clamped at the last dimension": {
        "rope_parameters": {**YARN, "rope_theta": 10.0, "original_max_position_embeddings": 1024}
    },
    "yarn, a zero-width ramp": {"rope_parameters": {**YARN, "original_max_position_embeddings": 6}},
}


@pytest.mark.parametrize("case", STATIC_CASES)
def test_static_types_match_transformers(case: str) -> None:
    raw = {**LLAMA, **STATIC_CASES[case]}
    module = LlamaRotaryEmbedding(transformers.LlamaConfig(**copy.deepcopy(raw)))
    table = ours(raw, 128)
    expected = reference(module, torch.arange(NUM_POSITIONS))
    assert_close(table, expected, module.attention_scaling)


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    rope = parse_rope(ConfigFields({**LLAMA, "rope_parameters": YARN}, "config.json"))
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    table = cos_sin_cache(rope, 128, 2)
    assert torch.equal(table[0, :64], torch.full((64,), rope.attention_factor))
    assert torch.equal(table[0, 64:], torch.zeros(64))


def test_dynamic_rows_match_transformers_decoding_one_token_at_a_time() -> None:
    raw = {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 3.7}}
    module = LlamaRotaryEmbedding(transformers.LlamaConfig(**copy.deepcopy(raw)))
    positions = spread(4096)
    assert_close(ours(raw, 128)[positions], decoded_rows(module, positions))


def test_longrope_rows_match_transformers_decoding_one_token_at_a_time() -> None:
    # Phi-3 layout: original_max_position_embeddings at the top level, partial rotary (dim 32).
    module = Phi3RotaryEmbedding(transformers.Phi3Config(**copy.deepcopy(PHI3)))
    positions = spread(4096)
    assert_close(
        ours(PHI3, 32)[positions], decoded_rows(module, positions), module.attention_scaling
    )
    assert module.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_prompt_below_the_original_length_matches_transformers_in_one_forward(
    rope_type: str,
) -> None:
    if rope_type == "dynamic":
        raw = {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 3.7}}
        module: torch.nn.Module = LlamaRotaryEmbedding(
            transformers.LlamaConfig(**copy.deepcopy(raw))
        )
        dim = 128
    else:
        raw, dim = PHI3, 32
        module = Phi3RotaryEmbedding(transformers.Phi3Config(**copy.deepcopy(PHI3)))
    expected = reference(module, torch.arange(4096))
    assert_close(ours(raw, dim)[:4096], expected, getattr(module, "attention_scaling", 1.0))


def test_a_longrope_sequence_past_the_original_length_reads_the_long_rows() -> None:
    """transformers rotates a whole forward past the original length with the long factors:
    the rows after ``max_positions`` hold its first positions so; the rows below the
    original length (a shorter sequence's) hold the short factors, which differ."""
    module = Phi3RotaryEmbedding(transformers.Phi3Config(**copy.deepcopy(PHI3)))
    expected = reference(module, torch.arange(4100))
    table = ours(PHI3, 32, 4100)
    assert table.shape[0] == 4100 + 4096
    assert_close(table[4096:4100], expected[4096:], module.attention_scaling)
    assert_close(table[4100:], expected[:4096], module.attention_scaling)
    assert (table[1:4096].double() - expected[1:4096, :32]).abs().max() > 0.5


def test_gemma3_per_layer_type_tables_match_transformers() -> None:
    raw = {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "max_position_embeddings": 32768,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    }
    module = Gemma3RotaryEmbedding(transformers.Gemma3TextConfig(**copy.deepcopy(raw)))
    fields = ConfigFields(raw, "config.json")
    for layer_type, table in raw["rope_parameters"].items():
        rope = parse_rope(fields, table, f"rope_parameters.{layer_type}")
        expected = reference(module, torch.arange(NUM_POSITIONS), layer_type=layer_type)
        assert_close(cos_sin_cache(rope, 64, NUM_POSITIONS), expected)


def test_a_table_falls_back_to_the_top_level_theta() -> None:
    fields = ConfigFields({"rope_theta": 1234.0}, "config.json")
    assert parse_rope(fields, {"rope_type": "default"}).theta == 1234.0


def test_rope_config_is_hashable_and_picklable() -> None:
    rope = parse_rope(ConfigFields(PHI3, "config.json"))
    assert rope.short_factor == SHORT and rope.original_max_position_embeddings == 4096
    assert pickle.loads(pickle.dumps(rope)) == rope
    assert hash(rope) == hash(parse_rope(ConfigFields(copy.deepcopy(PHI3), "config.json")))


def error_of(
    raw: dict[str, Any], table: dict[str, Any] | None = None, source: str | None = None
) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        parse_rope(ConfigFields(raw, "config.json"), table, source)
    assert info.value.path == "config.json"
    return info.value


def test_an_unknown_type_lists_the_supported_ones() -> None:
    error = error_of({"rope_scaling": {"type": "ntk-by-parts"}})
    assert error.field == "rope_scaling.rope_type"
    assert "'ntk-by-parts'" in str(error) and ", ".join(SUPPORTED_ROPE_TYPES) in str(error)


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "longrope", "long_factor": [1.0]}, "short_factor"),
    ],
)
def test_a_missing_key_is_named(table: dict[str, Any], field: str) -> None:
    error = error_of({"rope_parameters": table})
    assert error.field == f"rope_parameters.{field}" and "needs" in str(error)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("factor", 0),
        ("factor", -2.0),
        ("factor", float("inf")),
        ("factor", True),
        ("factor", "4"),
        ("factor", 10**400),
        ("beta_fast", "32"),
        ("mscale", -1.0),
        ("attention_factor", 0.0),
        ("truncate", "yes"),
        ("original_max_position_embeddings", 4096.5),
    ],
)
def test_a_bad_value_is_named(key: str, value: object) -> None:
    error = error_of(LLAMA, {**YARN, key: value}, "rope_parameters.full_attention")
    assert error.field == f"rope_parameters.full_attention.{key}"


@pytest.mark.parametrize(
    "factors", [[1.0, "2"], [1.0, None], [], "1.0", [1.0, float("nan")], [1.0, 0.0]]
)
def test_a_factor_list_that_is_not_positive_numbers_is_named(factors: object) -> None:
    error = error_of({**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "long_factor": factors}})
    assert error.field == "rope_scaling.long_factor" and "list of positive numbers" in str(error)


def test_a_factor_list_of_the_wrong_length_is_named() -> None:
    rope = parse_rope(ConfigFields(PHI3, "config.json"))
    with pytest.raises(ModelLoadError, match=r"short_factor has 16 entries.*needs 32") as info:
        check_rotary_dim(rope, 64, "config.json")
    assert info.value.field == "rope_scaling.short_factor" and info.value.path == "config.json"
    with pytest.raises(ModelLoadError):
        cos_sin_cache(rope, 64, 8)


def test_the_lengths_a_type_needs_are_named() -> None:
    assert (
        error_of({"rope_scaling": {"type": "dynamic", "factor": 2.0}}).field
        == "max_position_embeddings"
    )
    assert error_of({"rope_parameters": {"rope_type": "yarn"}}).field == "max_position_embeddings"


def test_per_layer_type_tables_read_flat_are_refused() -> None:
    raw = {"rope_parameters": {"full_attention": {"rope_type": "default"}}}
    assert error_of(raw).field == "rope_parameters.full_attention"


def test_llama3_needs_high_freq_factor_above_low() -> None:
    table = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}
    assert error_of({**LLAMA, "rope_parameters": table}).field == "rope_parameters.high_freq_factor"


def test_defaults_are_transformers_defaults() -> None:
    default = parse_rope(ConfigFields({}, "config.json"))
    assert default == RopeConfig(theta=10000.0)
    yarn = parse_rope(
        ConfigFields({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "c")
    )
    assert (yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow) == (
        4096,
        32.0,
        1.0,
    )
    assert yarn.truncate
