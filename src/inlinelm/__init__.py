"""inlinelm: an LLM serving engine that embeds in your Python process.

``Engine`` runs the model on one dedicated thread and delivers outputs to the caller's
event loop; ``inlinelm.api`` serves it as an OpenAI-compatible Starlette router.
"""

from inlinelm.config import EngineConfig
from inlinelm.errors import (
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
from inlinelm.runtime.engine import Engine
from inlinelm.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inlinelm.runtime.stream import RequestStream
from inlinelm.sampling_params import OutputKind, SamplingParams

__all__ = [
    "CompletionOutput",
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
    "SlowConsumerError",
]
