"""The HTTP edge of ``inlinelm serve``: what a client may hold, and for how long.

A server on a port is open to clients that never mean to finish a request. uvicorn
bounds some of that itself and this module adds the rest (:class:`EdgeLimits`):

==========================  ===================================  ===========================
limit                       past it                              by
==========================  ===================================  ===========================
``max_header_bytes``        431, connection closed               our httptools protocol
                                                                 (h11: uvicorn's
                                                                 ``h11_max_incomplete_event_size``)
``request_timeout_s``       connection closed (408 if part of    our httptools protocol
                            a head came)
``keep_alive_timeout_s``    idle connection closed               uvicorn's ``timeout_keep_alive``
``max_connections``         503 (uvicorn's plain-text answer)    uvicorn's ``limit_concurrency``
==========================  ===================================  ===========================

``max_connections`` counts open connections and running requests: once either reaches it,
every new request is answered 503 and its connection closed. A connection that never
sends a whole request gets no answer; it is closed when its ``request_timeout_s`` runs
out, so none holds a place longer than that.

:class:`EdgeServer` is uvicorn's server as ``inlinelm serve`` runs it; apps on their own
uvicorn pass ``http=edge_protocol(limits)`` and ``**limits.uvicorn_options()`` (README:
"Under your own server").
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

from inlinelm.api.app import start_all, uvicorn_options
from inlinelm.api.edge_limits import EdgeLimits as EdgeLimits  # NOTE: README imports it here
from inlinelm.errors import InlineLMError

if TYPE_CHECKING:
    from inlinelm.runtime.engine import Engine

logger = logging.getLogger("inlinelm.api.edge")


def edge_protocol(limits: EdgeLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits``' head cap and request deadline, for
    ``uvicorn.run(app, http=edge_protocol(limits), ...)`` (needs httptools)."""
    from inlinelm.api.edge_httptools import EdgeHttpToolsProtocol

    edge_limits = limits

    class LimitedProtocol(EdgeHttpToolsProtocol):
        limits = edge_limits

    return LimitedProtocol


def server_config(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    limits: EdgeLimits,
    log_level: str = "info",
    lifespan: str = "on",
) -> uvicorn.Config:
    """uvicorn's config as ``inlinelm serve`` runs it: uvloop and httptools
    (:func:`~inlinelm.api.app.uvicorn_options`), the limits uvicorn enforces itself, and no
    WebSocket support (the API has no WebSocket endpoint)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan=lifespan,  # type: ignore[arg-type]  # a Literal in uvicorn; checked there
        ws="none",
        **uvicorn_options(),
        **limits.uvicorn_options(),
    )


class EdgeServer(uvicorn.Server):
    """uvicorn's server as ``inlinelm serve`` runs it: the engine (or each of several
    ``engines``, in order) starts before any socket is bound, and every connection is
    served by :func:`edge_protocol` (with httptools).

    A start that fails with an ``InlineLMError`` (a model that does not load, an option
    the machine cannot honour) ends the run before the app's lifespan and before any
    socket is bound; the error is :attr:`startup_error`, for the caller to report in one
    line (uvicorn would log the lifespan's traceback). An interrupt while the model loads
    ends the run once it has loaded, without serving.
    """

    def __init__(
        self, config: uvicorn.Config, engines: Engine | Sequence[Engine], limits: EdgeLimits
    ) -> None:
        super().__init__(config)
        self.engines = list(engines) if isinstance(engines, Sequence) else [engines]
        self.limits = limits
        self.startup_error: InlineLMError | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start the engines, then uvicorn's start-up (lifespan, sockets) on the edge protocol."""
        try:
            await start_all(self.engines)
        except InlineLMError as error:
            self.startup_error = error
            self.should_exit = True
            return
        if self.should_exit:  # NOTE: interrupted while the model loaded
            return
        self._use_edge_protocol()
        await super().startup(sockets)

    def _use_edge_protocol(self) -> None:
        # NOTE: uvicorn's config names the parser ("httptools"); the edge goes on the
        # protocol it loaded, so what is configured stays what uvicorn documents.
        if self.config.http == "httptools":
            self.config.http_protocol_class = edge_protocol(self.limits)
        else:
            logger.warning(
                "HTTP parser %r: no deadline for a request to arrive (it needs httptools)",
                self.config.http,
            )
