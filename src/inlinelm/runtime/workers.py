"""The engine's worker threads for work that grows with one request (DESIGN invariant 12):
rendering, tokenizing and decoding large inputs. Off the event loop, so no request stalls
the others, and off the engine thread, which only runs steps. (Grammars compile on the
grammar compiler's own threads and child processes: :mod:`inlinelm.structured.compiler`.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from inlinelm.errors import EngineClosedError

T = TypeVar("T")


class Workers:
    """A small thread pool, ``inlinelm-tokenize`` (two threads), started on first use and
    stopped by :meth:`close`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._closed = False

    async def tokenize(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a tokenizer thread, awaited on the running loop."""
        return await self._run("tokenize", 2, fn, *args)

    def close(self) -> None:
        """Stop every thread (waiting for the work in hand; queued work is cancelled)."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)

    async def _run(self, name: str, threads: int, fn: Callable[..., T], *args: object) -> T:
        pool = self._pool(name, threads)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _pool(self, name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            pool = self._pools.get(name)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=threads, thread_name_prefix=f"inlinelm-{name}"
                )
                self._pools[name] = pool
            return pool


def decode_all(tokenizer: Any, lists: list[list[int]]) -> list[str]:
    """``[tokenizer.decode(ids) for ids in lists]``, with the GIL released while it runs
    when the tokenizer is a fast one (the Rust batch decode; transformers' own decode holds
    the GIL for the whole call, which stalls the event loop however many threads there are)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        # NOTE: transformers' space cleanup (its rules vary by version) follows the Rust
        # decode only through its own decode.
        return [str(tokenizer.decode(ids)) for ids in lists]
    texts: list[str] = backend.decode_batch(lists, skip_special_tokens=False)
    return texts
