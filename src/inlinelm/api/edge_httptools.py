"""uvicorn's httptools protocol with the two limits it lacks: a cap on a request's head, and
a deadline for a request to arrive.

httptools gathers a header's value in memory however long it grows (one 200 MB header
kept ``/health`` waiting for seconds), and no uvicorn protocol times out a request that
never completes (a client that opens a connection and sends nothing, or sends its headers
a byte at a time, holds the connection forever). Per connection, with one timer:

- a head (request line and headers) past ``max_header_bytes`` is answered 431 and the
  connection closed; the parser never sees more than the cap;
- a request must arrive whole, head and body, within ``request_timeout_s`` of its first
  byte (of the connection's opening, for the first request), or the connection is closed,
  with a 408 when part of a head came. The clock stops while uvicorn itself holds reading
  back (a pipelined request waiting its turn, a body the app has not read yet).

Everything else is uvicorn's: once a head is complete the request runs as it would, and
an idle keep-alive connection closes after ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inlinelm.api.edge_limits import EdgeLimits

logger = logging.getLogger("inlinelm.api.edge")


class EdgeHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with a head cap and a request deadline; see the module.

    uvicorn builds one per connection from the class it is given (``http=``), so the
    limits live on the class: :func:`~inlinelm.api.edge.edge_protocol` makes a subclass
    holding them.
    """

    limits: ClassVar[EdgeLimits] = EdgeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the next bytes belong to a request head
        self._head_started = False  # some of that head has arrived
        self._head_bytes = 0
        self._num_heads = 0
        self._deadline: asyncio.TimerHandle | None = None

    # -- the transport's calls -----------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; while a head is incomplete, never more than the cap allows."""
        if not self._in_head:
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - self._head_bytes
        num_heads = self._num_heads
        super().data_received(data[:room])  # NOTE: the whole of data (no copy) when it fits
        if self._num_heads == num_heads:  # the head is still incomplete
            # NOTE: bytes after a pipelined request's body start the next head uncounted:
            # that head may pass the cap by at most one read.
            self._head_bytes += min(len(data), room)
            if len(data) > room and self._reading_here():
                self._refuse_head()
            return
        if len(data) > room and self._reading_here():
            super().data_received(data[room:])

    # -- the parser's calls --------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        if self._deadline is None:
            self._arm_deadline()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_started, self._head_bytes = False, False, 0
        self._num_heads += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._disarm_deadline()

    # -- the limits ----------------------------------------------------------------------

    def _arm_deadline(self) -> None:
        self._deadline = self.loop.call_later(self.limits.request_timeout_s, self._on_deadline)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            # NOTE: uvicorn holds reading back (a pipelined request waits for the one
            # before it; the app has not read the body yet): the wait is ours, not the client's.
            self._arm_deadline()
            return
        if self._in_head and self._head_started:
            logger.info("%s sent no whole request head in %s s; answered 408", *self._who())
            self._answer_and_close(http.HTTPStatus.REQUEST_TIMEOUT)
            return
        logger.debug("%s sent no whole request in %s s; closed", *self._who())
        self.transport.close()

    def _refuse_head(self) -> None:
        logger.warning(
            "%s sent a request head over %d bytes; answered 431",
            self._who()[0],
            self.limits.max_header_bytes,
        )
        self._answer_and_close(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)

    def _answer_and_close(self, status: http.HTTPStatus) -> None:
        """A plain-text response outside any request cycle (none has begun), then close."""
        body = status.phrase.encode("ascii")
        lines = [f"HTTP/1.1 {status.value} {status.phrase}".encode("ascii")]
        lines += [name + b": " + value for name, value in self.server_state.default_headers]
        lines += [
            b"content-type: text/plain; charset=utf-8",
            b"content-length: " + str(len(body)).encode("ascii"),
            b"connection: close",
        ]
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        self.transport.close()
        self._disarm_deadline()

    def _reading_here(self) -> bool:
        """The connection is open and still this protocol's (not closed, not upgraded)."""
        return not self.transport.is_closing() and self.transport.get_protocol() is self

    def _who(self) -> tuple[str, float]:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        return client, self.limits.request_timeout_s
