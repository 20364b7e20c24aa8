"""Qwen3-MoE: Qwen3 whose MLPs are sparse mixtures of experts (some layers may stay dense)."""

from __future__ import annotations

from dataclasses import replace

from inlinelm.gpu.model.config import LayerSpec, ModelConfig, MoEConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models import qwen3
from inlinelm.gpu.model.models.family import Family


def configure(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """The experts, and which layers use them: every ``decoder_sparse_step``-th layer
    not in ``mlp_only_layers``."""
    cfg = qwen3.configure(fields, cfg)
    # NOTE: Hub configs write num_experts; transformers 5 saves it as num_local_experts.
    name = "num_local_experts" if "num_local_experts" in fields.raw else "num_experts"
    num_experts = fields.non_negative_int(name, 0)
    if num_experts == 0:
        return cfg
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=experts_per_token(fields, num_experts),
        intermediate_size=fields.positive_int("moe_intermediate_size"),
        renormalize=fields.boolean("norm_topk_prob", False),
    )
    step = fields.positive_int("decoder_sparse_step", 1)
    dense = set(fields.int_list("mlp_only_layers"))
    layers = tuple(
        replace(spec, sparse=i not in dense and (i + 1) % step == 0)
        for i, spec in enumerate(cfg.layers)
    )
    return replace(cfg, moe=moe, layers=layers)


def experts_per_token(fields: ConfigFields, num_experts: int) -> int:
    """``num_experts_per_tok``, at most the experts there are."""
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise fields.error(
            "num_experts_per_tok",
            f"num_experts_per_tok {top_k} is more than the {num_experts} experts",
        )
    return top_k


def all_sparse(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """Every layer of ``cfg`` with the sparse MLP."""
    return tuple(replace(spec, sparse=True) for spec in cfg.layers)


QWEN3_MOE = Family(
    name="Qwen3-MoE",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    examples=("Qwen/Qwen3-30B-A3B",),
    gguf="qwen3moe",
    configure=configure,
)
