"""Run a coroutine to completion from sync code: a script, any thread, or a Jupyter cell."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from inlinelm.runtime.engine import Engine, Prompt
    from inlinelm.runtime.outputs import RequestOutput
    from inlinelm.runtime.stream import RequestStream
    from inlinelm.sampling_params import SamplingParams

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


async def generate_all(
    engine: Engine, prompts: list[Prompt], params: SamplingParams | None, use_tqdm: bool
) -> list[RequestOutput]:
    """Run ``prompts`` concurrently on ``engine``, with a progress bar; outputs in order."""
    from tqdm.auto import tqdm

    await engine.start()
    streams = [engine.stream(p, params) for p in prompts]
    with tqdm(total=len(streams), disable=not use_tqdm, desc="generate") as bar:

        async def one(stream: RequestStream) -> RequestOutput:
            out = await stream
            bar.update(1)
            return out

        return list(await asyncio.gather(*(one(s) for s in streams)))
