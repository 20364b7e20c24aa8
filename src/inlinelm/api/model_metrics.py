"""The Prometheus registry of a router's engines: one engine's metrics as they are, several
engines' merged into one family per metric, each series labelled ``model_name`` (as vLLM
and SGLang label theirs).

An engine's collector (:meth:`~inlinelm.Engine.register_metrics`) names its metrics
without labels for the engine, so two of them on one registry would clash; each is kept on
a registry of its own, and :class:`ModelLabelled` collects them all under one name per
family: ``inlinelm_num_running{model_name="chat"}`` next to
``inlinelm_num_running{model_name="embed"}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from inlinelm.runtime.engine import Engine

MODEL_LABEL = "model_name"


def metrics_registry(engines: Mapping[str, Engine]) -> CollectorRegistry:
    """A registry of every engine's metrics: one engine's unlabelled, as a router of one
    engine always had them; several engines' labelled by the name each is served as."""
    registry = CollectorRegistry(auto_describe=True)
    if len(engines) == 1:
        (engine,) = engines.values()
        engine.register_metrics(registry)
        return registry
    registry.register(ModelLabelled({name: _own_registry(e) for name, e in engines.items()}))
    return registry


class ModelLabelled:
    """A collector of several registries, one per model: each family once, with every
    registry's samples in it, labelled ``model_name``."""

    def __init__(self, registries: Mapping[str, CollectorRegistry]) -> None:
        self._registries = dict(registries)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model, registry in self._registries.items():
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = into
                into.samples += [
                    sample._replace(labels={MODEL_LABEL: model, **sample.labels})
                    for sample in family.samples
                ]
        yield from merged.values()


def _own_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    engine.register_metrics(registry)
    return registry
