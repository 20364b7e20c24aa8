"""Run a coroutine to completion from sync code: a script, any thread, or a Jupyter cell."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from inlinelm.progress import progress_bar

if TYPE_CHECKING:
    from inlinelm.runtime.outputs import RequestOutput
    from inlinelm.runtime.stream import RequestStream

T = TypeVar("T")
Item = TypeVar("Item")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, or on a helper thread when this thread already runs a loop.

    No ``nest_asyncio``: a running loop (Jupyter) is left alone and the coroutine gets a
    private loop; the engine delivers outputs to whichever loop submitted the request.
    """
    if not _loop_running():
        # NOTE: outside the except block of _loop_running, so an error from ``coro`` is
        # not chained to "no running event loop".
        return asyncio.run(coro)
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=target, name="inlinelm-sync")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def generate_all(
    start: Callable[[], Awaitable[None]],
    items: Sequence[Item],
    open_stream: Callable[[Item], RequestStream],
    use_tqdm: bool,
) -> list[RequestOutput]:
    """``start`` the engine, open one stream per item and await them all concurrently, with a
    progress bar (shown on a terminal or in Jupyter); outputs in the items' order."""
    await start()
    streams = [open_stream(item) for item in items]
    with progress_bar(len(streams), "generate", enabled=use_tqdm) as bar:

        async def one(stream: RequestStream) -> RequestOutput:
            out = await stream
            bar.update(1)
            return out

        return list(await asyncio.gather(*(one(s) for s in streams)))
