"""An engine's life and state: its construction, start, close and health, and what it
tells about itself (:class:`~inlinelm.runtime.engine.Engine` adds the requests)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import logging
import threading
import time
import weakref
from typing import Any

from inlinelm.config import EngineConfig
from inlinelm.errors import EngineClosedError
from inlinelm.progress import silence_iprogress_warning
from inlinelm.reasoning import ReasoningParser
from inlinelm.runtime.bridge import (
    CoreHandle,
    Heartbeat,
    OutputDispatcher,
    close_loops,
    engine_health,
    post_outputs,
)
from inlinelm.runtime.loader import LoadedEngine, load_engine
from inlinelm.runtime.metrics import (
    EngineMetrics,
    EngineStats,
    PrometheusCollector,
    engine_stats,
)
from inlinelm.runtime.submission import Submitter
from inlinelm.runtime.workers import Workers
from inlinelm.structured.compiler import CacheStats

logger = logging.getLogger("inlinelm")


class EngineBase:
    """What every :class:`~inlinelm.runtime.engine.Engine` is before it takes requests:
    its config, its start (the model loaded off the event loop, the engine thread
    started) and close, its health and its stats."""

    def __init__(self, config: EngineConfig | None = None, /, **options: Any) -> None:
        base = config if config is not None else EngineConfig()
        self.config = base.with_options(**options) if options else base
        self.metrics = EngineMetrics()
        self._dispatcher = OutputDispatcher()
        self._start_future: concurrent.futures.Future[LoadedEngine] | None = None
        self._lock = threading.Lock()
        # NOTE: the handle holds the loaded parts and the closed flag: what the bridges,
        # timers and streams share with the Engine, without holding the Engine.
        self._handle = CoreHandle()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._heartbeat = Heartbeat(time.perf_counter())
        self._workers = Workers()
        self._submitter = Submitter(
            self.config,
            self._handle,
            self._dispatcher,
            self.metrics,
            self._heartbeat,
            self._workers,
            self.start,
        )

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and start the engine thread (idempotent); returns once warm."""
        # NOTE: shielded: a cancelled wait (an interrupted generate) must not cancel the
        # start every caller shares, or the load's result would be lost.
        await asyncio.shield(asyncio.wrap_future(self._begin_start()))

    def _begin_start(self) -> concurrent.futures.Future[LoadedEngine]:
        with self._lock:
            if self._handle.closed:
                raise EngineClosedError("the engine is closed")
            if self._start_future is None:
                self._start_future = concurrent.futures.Future()
                silence_iprogress_warning()
                threading.Thread(target=self._load, name="inlinelm-loader", daemon=True).start()
            return self._start_future

    def _load(self) -> None:
        assert self._start_future is not None
        try:
            # NOTE: the sink must not reference the Engine, so an Engine dropped without
            # close() is collected, and its finalizer stops the engine thread.
            loaded = load_engine(
                self.config, functools.partial(post_outputs, self._dispatcher, self._heartbeat)
            )
        except BaseException as e:
            self._start_future.set_exception(e)
            return
        self._finalizer = weakref.finalize(self, _shutdown, loaded)
        self._finalizer.atexit = False
        self._handle.loaded = loaded
        self._start_future.set_result(loaded)

    def start_sync(self) -> None:
        """Blocking ``start()`` for scripts and threads."""
        self._begin_start().result()

    async def aclose(self) -> None:
        """Stop the engine thread, fail open streams with ``EngineClosedError``, free memory."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Blocking ``aclose()`` (idempotent)."""
        with self._lock:
            if self._handle.closed:
                return
            self._handle.closed = True
            future = self._start_future
        if future is not None:
            try:
                loaded = future.result()
            except BaseException:
                loaded = None
            if loaded is not None:
                loaded.core.shutdown()
                loaded.core.join()
                loaded.grammars.close()
        close_loops(self._dispatcher, EngineClosedError("the engine was closed"))
        self._workers.close()
        # NOTE: drop every path to the core (and so to the runner's weights and KV cache).
        self._handle.loaded = None
        self._start_future = None
        if self._finalizer is not None:
            self._finalizer.detach()
        gc.collect()

    # -- state ---------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """True once the model is loaded and warm and the engine thread runs."""
        return self._handle.loaded is not None and not self._handle.closed

    def health(self, *, detail: bool = True) -> tuple[bool, str]:
        """``(True, "ok")``, or ``(False, reason)`` when closed, dead or stuck in a step.

        A death's reason names the error's class and, with ``detail``, its message (which
        may hold internals: an HTTP server shows clients the class only).
        """
        return engine_health(
            self._handle, self._dispatcher, self._heartbeat, self.config.step_timeout_s, detail
        )

    def __repr__(self) -> str:
        """What the engine serves and its state, e.g. ``<Engine model='default' on cpu:
        ready, 2 running, 0 waiting, KV blocks 40/8192 used>``."""
        config = self.config
        served = f"model={config.model!r}"
        if config.runner != "model":
            served += f" runner={config.runner!r}"
        ok, reason = self.health(detail=False)
        if self._start_future is None and not self._handle.closed:
            state = "not started"
        elif ok or reason.startswith("stuck"):
            state = self.stats().summary("ready" if ok else reason)
        else:
            state = reason
        return f"<Engine {served} on {config.device}: {state}>"

    @property
    def healthy(self) -> bool:
        """False when the engine is closed, dead or stuck."""
        return self.health()[0]

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer); available once started."""
        return self._submitter.require_loaded().tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the engine serves."""
        return self._submitter.require_loaded().max_model_len

    @property
    def model_name(self) -> str:
        """The served model id."""
        model = self.config.model
        return "default" if model == "default" else model.rstrip("/").split("/")[-1]

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        """The parser that splits a chat's reasoning from its answer unless a chat names
        another (the ``reasoning_parser`` option resolved; None: answers stay whole);
        available once started."""
        return self._submitter.require_loaded().reasoning

    @property
    def num_kv_blocks(self) -> int:
        """Size of the KV block pool."""
        return self._submitter.require_loaded().core.stats.num_kv_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        """Free KV blocks after the last engine step."""
        return self._submitter.require_loaded().core.stats.num_free_blocks

    def stats(self) -> EngineStats:
        """Engine-wide numbers: queues, KV use, prefix-cache hit rate, histograms, coalescing,
        and the grammar cache (hits, misses, compiles abandoned by their clients, entries and
        their estimated bytes). A dict, which a notebook shows as a short table."""
        loaded = self._handle.loaded
        return engine_stats(
            loaded.core.stats if loaded is not None else None,
            self.metrics,
            num_queued=self._handle.num_queued_requests,
            num_coalesced_steps=sum(b.num_coalesced_steps for b in self._dispatcher.bridges()),
            grammars=loaded.grammars.stats if loaded is not None else CacheStats(),
        )

    def register_metrics(self, registry: Any) -> None:
        """Register a Prometheus collector for this engine on ``registry``."""
        registry.register(PrometheusCollector(self.stats, self.metrics))


def _shutdown(loaded: LoadedEngine) -> None:
    """What an Engine dropped without close() stops: the engine thread and the grammar
    compiler's threads and child processes."""
    loaded.core.shutdown()
    loaded.grammars.close()
