"""An HTTP request carried whole from an ingress to an engine replica, and its answer back.

A routing ingress must read a request's body to choose a replica, so it cannot hand the
replica the client's connection; it sends a :class:`ForwardedRequest` instead. The replica
runs its own ASGI app (the OpenAI router, unchanged) on it with :func:`serve_forwarded`,
which yields the app's response messages in batches; the ingress relays
them to its client with :func:`relay`. Nothing here knows Ray: any transport that carries
picklable values and cancels its producer when the consumer stops will do.

What crosses is ASGI's own ``http.response.start`` / ``http.response.body`` messages, so a
400 is still a 400 before any 200, a 429 keeps its ``Retry-After``, and an SSE stream
arrives a frame batch at a time. A batch is every message the app has sent since the last
one was taken, gathered for up to ``batch_s`` once the first token is out: the hop costs
per batch, not per frame.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inlinelm.api.body import read_body
from inlinelm.api.errors import APIError
from inlinelm.api.sse import frame
from inlinelm.serve.prefix import prefix_key

MessageBatch = list[Message]


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request, read whole, on its way to the replica that serves it.

    ``prefix_key`` is what a prefix-aware router routes it by (see
    :func:`inlinelm.serve.prefix.prefix_key`); the replica ignores it. As in ASGI, ``path``
    includes ``root_path``, the prefix the app is mounted under.
    """

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    prefix_key: str | None = None
    client: tuple[str, int] | None = None
    root_path: str = ""

    @classmethod
    def from_scope(cls, scope: Scope, body: bytes, prefix_key: str | None) -> ForwardedRequest:
        """The request that ``scope`` (an ASGI ``http`` scope) and ``body`` make."""
        client = scope.get("client")
        return cls(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])),
            body=body,
            prefix_key=prefix_key,
            client=(client[0], client[1]) if client else None,
            root_path=scope.get("root_path", ""),
        )

    def scope(self) -> Scope:
        """An ASGI ``http`` scope for the replica's app."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": self.root_path,
            "query_string": self.query_string,
            "headers": [list(h) for h in self.headers],
            "client": self.client,
            "server": None,
        }


async def serve_forwarded(
    app: ASGIApp, request: ForwardedRequest, batch_s: float = 0.0
) -> AsyncIterator[MessageBatch]:
    """Run ``app`` on ``request``; yield its response messages, a batch at a time.

    A batch is what the app has sent since the last one was taken, its body chunks joined
    into one message. With ``batch_s``, each
    batch after the first two with body chunks waits up to ``batch_s`` for more (never past
    the response's end): a hop that costs per item (a Ray streaming call) then costs per
    ``batch_s``, not per engine step. The first two go at once (a chat's role chunks, then
    its first token), so the time to first token does not wait.

    Closing the iterator early (the client left, the ingress cancelled) tells the app its
    client disconnected and then cancels it, so a stream's ``finally`` aborts its engine
    request and frees its blocks. An exception the app raises is raised here.
    """
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    call = _AppCall(request.body)
    task = asyncio.create_task(call.run(app, request.scope(), sent))
    num_body_batches = 0
    try:
        while True:
            batch = [await sent.get()]
            if batch_s > 0 and num_body_batches >= 2 and batch[0] is not None:
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(call.ended.wait(), batch_s)
            while not sent.empty():
                batch.append(sent.get_nowait())
            ended = batch[-1] is None
            messages = _joined([m for m in batch if m is not None])
            num_body_batches += any(m["type"] == "http.response.body" for m in messages)
            if messages:
                yield messages
            if ended:
                break
        await task  # NOTE: raises what the app raised
    finally:
        await call.stop(task)


def _joined(messages: list[Message]) -> list[Message]:
    """``messages`` with each run of body chunks joined into one (one message to carry)."""
    joined: list[Message] = []
    for message in messages:
        last = joined[-1] if joined else None
        if (
            last is not None
            and message["type"] == last["type"] == "http.response.body"
            and last.get("more_body", False)
        ):
            joined[-1] = {
                "type": "http.response.body",
                "body": last.get("body", b"") + message.get("body", b""),
                "more_body": message.get("more_body", False),
            }
        else:
            joined.append(message)
    return joined


@dataclass
class _AppCall:
    """The ``receive`` side of one app call: the body once, then a disconnect when told."""

    body: bytes
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    _body_taken: bool = False
    _left: asyncio.Event = field(default_factory=asyncio.Event)

    async def receive(self) -> Message:
        if not self._body_taken:
            self._body_taken = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def run(self, app: ASGIApp, scope: Scope, sent: asyncio.Queue[Message | None]) -> None:
        async def send(message: Message) -> None:
            sent.put_nowait(message)

        try:
            await app(scope, self.receive, send)
        finally:
            sent.put_nowait(None)
            self.ended.set()

    async def stop(self, task: asyncio.Task[None]) -> None:
        """End the call: a disconnect first (what a client's leaving looks like), then cancel."""
        self._left.set()
        if not task.done():
            task.cancel()
        with suppress(asyncio.CancelledError):
            await task


async def relay(
    batches: AsyncIterator[MessageBatch],
    send: Send,
    receive: Receive,
    on_failure: Callable[[BaseException], APIError],
) -> None:
    """Send ``batches`` to the client; stop early, closing ``batches``, if the client leaves.

    When ``batches`` fails, the client gets ``on_failure(exc)``'s error: as the response when
    nothing was sent yet, else, for an event stream, as a last ``data: {"error": ...}``
    frame and ``[DONE]`` (what the router sends for an error after the 200).
    """
    relayed = _Relayed()
    pump = asyncio.ensure_future(_pump(batches, send, relayed))
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        client_left = watch.done()
    finally:
        for task in (pump, watch):
            task.cancel()
        await asyncio.gather(pump, watch, return_exceptions=True)
        aclose: Callable[[], Awaitable[Any]] | None = getattr(batches, "aclose", None)
        if aclose is not None:
            with suppress(Exception):
                await aclose()
    error = pump.exception() if not pump.cancelled() else None
    if error is not None and not client_left:
        await _send_failure(send, relayed, on_failure(error))


@dataclass
class _Relayed:
    started: bool = False
    ended: bool = False
    event_stream: bool = False


async def _pump(batches: AsyncIterator[MessageBatch], send: Send, relayed: _Relayed) -> None:
    async for batch in batches:
        for message in batch:
            if message["type"] == "http.response.start":
                relayed.started = True
                relayed.event_stream = any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in message.get("headers", [])
                )
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                relayed.ended = True
            await send(message)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_failure(send: Send, relayed: _Relayed, error: APIError) -> None:
    body = orjson.dumps(error.body())
    if not relayed.started:
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif not relayed.ended:
        tail = frame(body) + frame(b"[DONE]") if relayed.event_stream else b""
        await send({"type": "http.response.body", "body": tail})


class ForwardingApp:
    """An ASGI app that reads each HTTP request whole and forwards it with ``open_stream``.

    ``open_stream`` sends a :class:`ForwardedRequest` (its ``prefix_key`` from
    :func:`~inlinelm.serve.prefix.prefix_key`) to a replica and iterates the replica's
    response batches; :func:`relay` brings them to the client. A body past
    ``max_request_bytes`` is a 413 here, before anything is forwarded.
    """

    def __init__(
        self,
        open_stream: Callable[[ForwardedRequest], AsyncIterator[MessageBatch]],
        max_request_bytes: int,
        prefix_chars: int,
        on_failure: Callable[[BaseException], APIError],
    ) -> None:
        self.open_stream = open_stream
        self.max_request_bytes = max_request_bytes
        self.prefix_chars = prefix_chars
        self.on_failure = on_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            body = await read_body(Request(scope, receive), self.max_request_bytes)
        except ClientDisconnect:
            return
        except APIError as error:
            await _send_failure(send, _Relayed(), error)
            return
        key = prefix_key(scope["path"], body, self.prefix_chars)
        request = ForwardedRequest.from_scope(scope, body, key)
        await relay(self.open_stream(request), send, receive, self.on_failure)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
