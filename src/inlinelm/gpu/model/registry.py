"""Every model family we run, by ``model_type`` and ``architectures`` entry: reading a
config.json into its :class:`~inlinelm.gpu.model.config.ModelConfig`, and building the
family's model for it.

The README's table of supported architectures is generated from :data:`FAMILIES`
(``python -m inlinelm.docs readme``); a test fails while it is stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inlinelm.gpu.attention.metadata import AttentionBackend
from inlinelm.gpu.model.config import ModelConfig, base_config
from inlinelm.gpu.model.fields import ConfigFields, read_config_json, show
from inlinelm.gpu.model.kernels import Kernels
from inlinelm.gpu.model.models.decoder import DecoderModel
from inlinelm.gpu.model.models.family import Family
from inlinelm.gpu.model.models.gemma2 import GEMMA2
from inlinelm.gpu.model.models.gemma3 import GEMMA3
from inlinelm.gpu.model.models.granite import GRANITE
from inlinelm.gpu.model.models.llama import LLAMA, MISTRAL, QWEN2
from inlinelm.gpu.model.models.mixtral import MIXTRAL
from inlinelm.gpu.model.models.olmo2 import OLMO2
from inlinelm.gpu.model.models.phi3 import PHI3
from inlinelm.gpu.model.models.qwen3 import QWEN3
from inlinelm.gpu.model.models.qwen3_moe import QWEN3_MOE
from inlinelm.gpu.model.models.smollm3 import SMOLLM3
from inlinelm.gpu.model.rope import check_rotary_dim

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    MIXTRAL,
    GEMMA2,
    GEMMA3,
    PHI3,
    OLMO2,
    GRANITE,
    SMOLLM3,
)
_BY_MODEL_TYPE = {t: family for family in FAMILIES for t in family.model_types}
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)
SUPPORTED_ARCHITECTURES = tuple(a for family in FAMILIES for a in family.architectures)
"""The ``architectures`` entries of a config we run (a checkpoint of another head, such as
a classifier or an encoder, holds other tensors)."""
BARE_ARCHITECTURES = tuple(a.removesuffix("ForCausalLM") + "Model" for a in SUPPORTED_ARCHITECTURES)
"""The same decoders saved without their LM head (``Qwen3Model``: how sentence-transformers
saves a decoder embedder such as Qwen3-Embedding)."""


def family_of(model_type: str) -> Family:
    """The family of a supported ``model_type``."""
    return _BY_MODEL_TYPE[model_type]


def read_model_config(folder: Path) -> ModelConfig:
    """Read and check ``folder/config.json``.

    Raises ``ModelLoadError`` naming the file and the field at fault: an unreadable file,
    a value of the wrong type or out of range, head counts that do not divide, an
    architecture we do not run. Sizes are not judged here (see ``model_memory``).
    """
    return parse_config(read_config_json(folder), str(folder / "config.json"))


def parse_config(raw: dict[str, Any], path: str) -> ModelConfig:
    """Check a parsed config.json (``path`` names it in errors) and build its ModelConfig:
    the Llama-shaped fields, then what its family adds."""
    fields = ConfigFields(raw, path)
    family = _family(fields)
    model_type = str(raw["model_type"])
    cfg = family.configure(
        fields, base_config(fields, model_type, model_wide_window=family.model_wide_window)
    )
    for rope in (cfg.rope, cfg.local_rope):
        if rope is not None:
            check_rotary_dim(rope, cfg.rotated_dim, path)
    return cfg


def build_model(
    cfg: ModelConfig, backend: AttentionBackend, max_positions: int, kernels: Kernels | None
) -> DecoderModel:
    """The (empty) model of ``cfg``'s family."""
    return family_of(cfg.model_type).model(cfg, backend, max_positions, kernels)


def _family(fields: ConfigFields) -> Family:
    model_type = fields.raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in _BY_MODEL_TYPE:
        raise fields.error(
            "model_type",
            f"unsupported architecture {show(model_type)}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    family = _BY_MODEL_TYPE[model_type]
    architectures = fields.raw.get("architectures")
    if architectures is None:
        return family
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise fields.error("architectures", f"invalid architectures: {show(architectures)}")
    if not set(architectures) & {*SUPPORTED_ARCHITECTURES, *BARE_ARCHITECTURES}:
        raise fields.error(
            "architectures",
            f"unsupported architectures {show(architectures)}; inlinelm runs causal LMs: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return family


def architecture_table() -> str:
    """The README's table of supported architectures, in Markdown."""
    rows = [
        "| Family | `model_type` | Example checkpoints | GGUF | CPU / CUDA |",
        "|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        types = ", ".join(f"`{t}`" for t in family.model_types)
        examples = ", ".join(f"`{e}`" for e in family.examples)
        gguf = f"yes (`{family.gguf}`)" if family.gguf else "no"
        rows.append(f"| {family.name} | {types} | {examples} | {gguf} | yes / yes* |")
    return "\n".join(rows) + "\n"
