"""Run a coroutine to completion from sync code: a script, any thread, or a Jupyter cell."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, or on a helper thread when this thread already runs a loop.

    No ``nest_asyncio``: a running loop (Jupyter) is left alone and the coroutine gets a
    private loop; the engine delivers outputs to whichever loop submitted the request.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
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
