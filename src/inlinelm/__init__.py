"""inlinelm: an LLM serving engine that embeds in your Python process.

``Engine`` runs the model on one dedicated thread and delivers outputs to the caller's
event loop; ``inlinelm.api`` serves it as an OpenAI-compatible Starlette router.

Logging: inlinelm logs on the ``inlinelm`` logger (and its children, such as
``inlinelm.gpu.loading.model_files``) and configures no handler itself. To see the model being
converted and loaded, the KV-cache size and the sampling defaults::

    import logging
    logging.basicConfig(level=logging.INFO)                   # everything at INFO
    logging.getLogger("inlinelm").setLevel(logging.INFO)      # or inlinelm alone

On a terminal or in Jupyter, the first start also draws progress bars for the GGUF
conversion and the weight loading; elsewhere only the log shows them. See
docs/logging.md.
"""

from inlinelm.config import EngineConfig
from inlinelm.errors import (
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
from inlinelm.runtime.engine import Engine
from inlinelm.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    RequestMetrics,
    RequestOutput,
    ScoreOutput,
    TokenLogprobs,
)
from inlinelm.runtime.stream import RequestStream
from inlinelm.sampling_params import OutputKind, SamplingParams

__all__ = [
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
