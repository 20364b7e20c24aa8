"""What the registry knows of one model family: its names, its model class, how its
config.json differs from Llama's, how its checkpoint names differ from ours."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from inlinelm.gpu.model.config import ModelConfig
from inlinelm.gpu.model.fields import ConfigFields
from inlinelm.gpu.model.models.decoder import DecoderModel

Configure = Callable[[ConfigFields, ModelConfig], ModelConfig]


def unchanged(fields: ConfigFields, cfg: ModelConfig) -> ModelConfig:
    """The configure step of a family whose config is Llama's."""
    return cfg


@dataclass(frozen=True, slots=True)
class Family:
    """One family of checkpoints we run.

    ``configure`` turns the Llama-shaped :func:`~inlinelm.gpu.model.config.base_config`
    into the family's (reading its own fields); ``model_wide_window``: a
    ``sliding_window`` without ``layer_types`` windows every layer. ``checkpoint_names``
    are regex substitutions from a layer's checkpoint tensor names (after
    ``model.layers.N.``) to ours, applied in order. ``examples`` are checkpoints on the
    Hugging Face Hub; ``gguf`` the ``general.architecture`` llama.cpp writes for it (None:
    no GGUF loading).
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    examples: tuple[str, ...]
    gguf: str | None
    model: type[DecoderModel] = DecoderModel
    configure: Configure = unchanged
    model_wide_window: bool = False
    checkpoint_names: tuple[tuple[str, str], ...] = ()
