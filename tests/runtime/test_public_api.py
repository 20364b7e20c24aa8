"""The public API of ``inlinelm`` is small, sorted and pinned."""

from __future__ import annotations

import inlinelm

PUBLIC = [
    "CompletionOutput",
    "ConfigError",
    "EmbeddingOutput",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "InlineLMError",
    "ModelLoadError",
    "OutputKind",
    "QueueFullError",
    "QueueTimeoutError",
    "RequestError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ScoreOutput",
    "SlowConsumerError",
    "TokenLogprobs",
]


def test_all_is_pinned_and_sorted() -> None:
    assert inlinelm.__all__ == PUBLIC
    assert sorted(inlinelm.__all__) == inlinelm.__all__


def test_every_public_name_resolves_and_has_a_docstring() -> None:
    for name in inlinelm.__all__:
        obj = getattr(inlinelm, name)
        assert obj.__doc__, f"{name} has no docstring"


def test_error_hierarchy() -> None:
    from inlinelm import (
        ConfigError,
        EngineClosedError,
        EngineDeadError,
        InlineLMError,
        ModelLoadError,
        QueueFullError,
        QueueTimeoutError,
        RequestError,
        RequestFailedError,
        SlowConsumerError,
    )
    from inlinelm.errors import EngineError

    assert issubclass(EngineDeadError, EngineError)
    assert issubclass(EngineClosedError, EngineError)
    assert issubclass(EngineError, InlineLMError)
    assert issubclass(QueueTimeoutError, RequestFailedError)
    assert issubclass(SlowConsumerError, RequestFailedError)
    assert issubclass(RequestFailedError, InlineLMError)
    assert issubclass(QueueFullError, RequestError)
    assert issubclass(RequestError, ValueError)
    assert issubclass(ConfigError, InlineLMError) and issubclass(ConfigError, ValueError)
    assert not issubclass(ConfigError, RequestError)
    assert issubclass(ModelLoadError, ValueError)
    assert not issubclass(RequestFailedError, RequestError)
    assert not issubclass(EngineError, RequestError)


def test_the_engine_public_methods_have_docstrings() -> None:
    from inlinelm import Engine, RequestStream

    for cls, names in (
        (
            Engine,
            (
                "start",
                "aclose",
                "close",
                "start_sync",
                "stream",
                "chat",
                "generate",
                "stats",
                "health",
                "register_metrics",
            ),
        ),
        (RequestStream, ("aclose",)),
    ):
        for name in names:
            assert getattr(cls, name).__doc__, f"{cls.__name__}.{name} has no docstring"
