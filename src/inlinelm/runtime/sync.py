"""Run a coroutine to completion from sync code: a script, any thread, or a Jupyter cell.

An interrupt stops the coroutine's requests before it propagates. In a script
``asyncio.run`` turns Ctrl-C (SIGINT, ``_thread.interrupt_main()``) into a cancellation of
the coroutine, so its streams abort and its progress bar closes, then it raises
``KeyboardInterrupt``. In a Jupyter cell the coroutine runs on a helper thread and the
interrupt lands in the caller's wait for it: the wait cancels the helper's task, waits (at
most :data:`CANCEL_WAIT_S`) until its loop has sent the aborts and closed the bar, then
re-raises. Either way the engine thread frees the requests' KV blocks at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from inlinelm.progress import progress_bar

if TYPE_CHECKING:
    from inlinelm.runtime.outputs import RequestOutput
    from inlinelm.runtime.stream import RequestStream

T = TypeVar("T")
Item = TypeVar("Item")

CANCEL_WAIT_S = 10.0
"""How long an interrupted caller waits for the helper loop to abort its requests."""

WAIT_SLICE_S = 0.1
"""The caller waits for the helper thread in slices this long (see :func:`_wait`)."""


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, or on a helper thread when this thread already runs a loop.

    No ``nest_asyncio``: a running loop (Jupyter) is left alone and the coroutine gets a
    private loop; the engine delivers outputs to whichever loop submitted the request.
    An exception that interrupts the wait (``KeyboardInterrupt``) cancels the coroutine
    first, and is raised once the helper loop has finished (see the module docstring).
    """
    if not _loop_running():
        # NOTE: outside the except block of _loop_running, so an error from ``coro`` is
        # not chained to "no running event loop".
        return asyncio.run(coro)
    helper = HelperLoop(coro)
    threading.Thread(target=helper.run, name="inlinelm-sync").start()
    try:
        _wait(helper, deadline=None)
    except BaseException:
        _cancel_and_wait(helper)
        raise
    return helper.outcome()


class HelperLoop(Generic[T]):
    """A coroutine run by :meth:`run` on a private loop (in a helper thread), cancellable
    from any thread with :meth:`cancel`."""

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False
        self._result: list[T] = []
        self._error: list[BaseException] = []
        self._finished = threading.Event()

    def run(self) -> None:
        """The helper thread's body: ``asyncio.run`` the coroutine, keep its outcome."""
        try:
            self._result.append(asyncio.run(self._main()))
        except BaseException as e:
            self._error.append(e)
        finally:
            self._finished.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for :meth:`run` to return; True once it has."""
        return self._finished.wait(timeout)

    def cancel(self) -> None:
        """Cancel the coroutine (any thread; idempotent). Before it starts, it never runs."""
        with self._lock:
            self._cancelled = True
            loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # NOTE: the loop already closed
                loop.call_soon_threadsafe(self._cancel_task)

    def outcome(self) -> T:
        """The coroutine's result, or its exception raised; once :meth:`run` returned."""
        if self._error:
            raise self._error[0]
        return self._result[0]

    async def _main(self) -> T:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            cancelled = self._cancelled
        if cancelled:
            self._coro.close()
            raise asyncio.CancelledError
        return await self._coro

    def _cancel_task(self) -> None:
        # NOTE: on the helper loop; once only, so repeated requests do not cancel the
        # cleanup the first one started.
        task, self._task = self._task, None
        if task is not None:
            task.cancel()


def _wait(helper: HelperLoop[Any], deadline: float | None) -> None:
    """Wait until ``helper`` has run, or until ``deadline`` (``time.monotonic()``) passes.

    On an event, not ``Thread.join()``: on Python 3.11 an interrupted ``join()`` marks the
    still running thread as stopped. In slices: ``_thread.interrupt_main()`` (how some
    front ends interrupt) sends no real signal, so it is seen only between two waits.
    """
    while True:
        left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if left <= 0 or helper.wait(left):
            return


def _cancel_and_wait(helper: HelperLoop[Any]) -> None:
    """Cancel ``helper`` and wait (bounded) until it has run, so its requests are aborted
    and its progress bar closed before the caller's interrupt propagates.

    A second interrupt during the wait is absorbed: the cancellation is re-sent and the
    wait goes on, so the helper still aborts everything and the first interrupt is the
    one raised. The bound keeps a stuck helper from holding the caller; that helper has
    been cancelled and aborts on its own when it gets to run.
    """
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        try:
            helper.cancel()
            _wait(helper, deadline)
            return
        except BaseException:  # NOTE: a second interrupt (see the docstring)
            if time.monotonic() >= deadline:
                return


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
    progress bar (shown on a terminal or in Jupyter); outputs in the items' order.

    Cancelled (an interrupt) or failed (one request's error), it aborts every request
    still running before it returns, and the bar is closed."""
    await start()
    streams: list[RequestStream] = []
    try:
        for item in items:
            streams.append(open_stream(item))
        with progress_bar(len(streams), "generate", enabled=use_tqdm) as bar:

            async def one(stream: RequestStream) -> RequestOutput:
                out = await stream
                bar.update(1)
                return out

            return list(await asyncio.gather(*(one(s) for s in streams)))
    finally:
        # NOTE: gather leaves the other streams running when one fails, and a stream whose
        # task was cancelled before its first step never ran its own abort.
        for stream in streams:
            await stream.aclose()
