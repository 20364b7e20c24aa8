"""Which models a command line serves: ``--model NAME=MODEL`` values, their served names,
and the engine config of each (the engine flags apply to every model)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import NamedTuple

from inlinelm.config import EngineConfig


class UsageError(Exception):
    """Flags that parse one by one but cannot work together (two models served under one
    name); ``main`` prints the usage and this message, and exits with 2."""


class ModelFlag(NamedTuple):
    """One ``--model`` value: the name it is served as, when it gives one, and the model."""

    name: str | None
    model: str


def model_flags(args: argparse.Namespace) -> list[ModelFlag]:
    """The ``--model`` values in the order given (none given: ``EngineConfig``'s model).

    A value is ``NAME=MODEL`` or ``MODEL``; one that names an existing file or folder, or
    ``default``, is a model whatever it holds (a path may hold ``=``), any other is split
    at its first ``=``. A ``UsageError`` for an empty name or model.
    """
    values: list[str] = getattr(args, "model", None) or [EngineConfig().model]
    flags = []
    for value in values:
        name, eq, model = value.partition("=")
        if not eq or value == "default" or Path(value).expanduser().exists():
            flags.append(ModelFlag(None, value))
        elif not name or not model:
            raise UsageError(f"--model {value!r}: give both NAME and MODEL in NAME=MODEL")
        else:
            flags.append(ModelFlag(name, model))
    return flags


def served_models(args: argparse.Namespace) -> dict[str, str]:
    """Each model to serve by the name clients send for it (``--model NAME=MODEL``, else
    ``--served-model-name`` for a single model, else the model's own name), in order.

    A ``UsageError`` for two models under one name, ``--served-model-name`` with several
    models (each names itself) or naming a model ``NAME=MODEL`` names otherwise, and
    ``--ray`` with several models (a Ray app serves one).
    """
    from inlinelm.runtime.engine import Engine

    flags = model_flags(args)
    several = len(flags) > 1
    if several and args.served_model_name is not None:
        raise UsageError(
            "--served-model-name names a single model; name each of several models as "
            "--model NAME=MODEL"
        )
    if several and args.ray:
        raise UsageError("--ray serves a single model: give one --model")
    (first, *_) = flags
    if first.name is not None and args.served_model_name not in (None, first.name):
        raise UsageError(
            f"the model is named twice: --model {first.name}=... and --served-model-name "
            f"{args.served_model_name}"
        )
    served: dict[str, str] = {}
    for flag in flags:
        # NOTE: the name an Engine gives itself (its file or folder name), so none is made up here.
        name = flag.name or args.served_model_name or Engine(model=flag.model).model_name
        if name in served:
            raise UsageError(
                f"two models are served as {name!r} ({served[name]} and {flag.model}): "
                "name them apart with --model NAME=MODEL"
            )
        served[name] = flag.model
    return served


def engine_configs(args: argparse.Namespace) -> dict[str, EngineConfig]:
    """The config of each model :func:`served_models` names, by its served name: the
    engine flags apply to every model."""
    return {name: engine_config(args, model) for name, model in served_models(args).items()}


def engine_config(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """The config the parsed flags describe (unset flags keep ``EngineConfig``'s defaults),
    for ``model`` (default: the first ``--model``'s)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    options = {k: v for k, v in vars(args).items() if k in names}
    options["model"] = model if model is not None else model_flags(args)[0].model
    return EngineConfig().with_options(**options)
