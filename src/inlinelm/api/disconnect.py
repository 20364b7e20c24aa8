"""Waiting for whole (non-streamed) answers while watching for the client to leave."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import anyio
from starlette.types import Receive

from inlinelm.api.sse import OutputStream
from inlinelm.runtime.outputs import RequestOutput


async def finals_unless_disconnected(
    receive: Receive, streams: Sequence[OutputStream]
) -> list[RequestOutput] | None:
    """Every stream's final output, or None when the client disconnects first.

    A plain response cannot notice a disconnect by writing, so the next ASGI message is
    awaited alongside: once the body is read, the only one that can come is the disconnect.
    Every stream is aborted before this returns (a no-op for finished ones); an engine
    error of any stream is raised.
    """
    finals = asyncio.ensure_future(asyncio.gather(*(_final(s) for s in streams)))
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    both: set[asyncio.Future[Any]] = {finals, gone}
    try:
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        return finals.result() if finals.done() else None
    finally:
        gone.cancel()
        finals.cancel()
        # NOTE: shielded: the abort must reach the engine even when this task is cancelled.
        with anyio.CancelScope(shield=True):
            await asyncio.wait(both)
            for stream in streams:
                await stream.aclose()


async def _final(stream: OutputStream) -> RequestOutput:
    return await stream


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
