"""The limits of the HTTP edge (:class:`EdgeLimits`); what answers each is in
:mod:`inlinelm.api.edge`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inlinelm.errors import ConfigError

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 1024


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """How much a client may send before its request is whole, how long it may take, how
    long an idle connection stays, and how many connections the server holds (see the
    module docstring for what answers each). ``max_connections=None``: no bound."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024:
            raise ConfigError(
                f"max_header_bytes must be at least 1024, got {self.max_header_bytes}",
                option="max_header_bytes",
            )
        for option in ("request_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, option) > 0:
                raise ConfigError(
                    f"{option} must be positive, got {getattr(self, option)}", option=option
                )
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(
                f"max_connections must be at least 1, got {self.max_connections}",
                option="max_connections",
            )

    def uvicorn_options(self) -> dict[str, Any]:
        """The limits uvicorn enforces itself, as ``uvicorn.Config`` / ``uvicorn.run``
        keywords (the rest need :func:`edge_protocol` as ``http=``)."""
        return {
            "limit_concurrency": self.max_connections,
            "timeout_keep_alive": self.keep_alive_timeout_s,
            "h11_max_incomplete_event_size": self.max_header_bytes,
        }
