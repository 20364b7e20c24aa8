"""Helpers every test folder shares: the one seam into an engine's internals, the one
blocking wait on a condition, and where a test's server listens.

Tests that need to see inside a running engine (its engine core, its loops' bridges) go
through the functions here, never through ``engine._…`` attributes, so a change to how the
``Engine`` holds its parts is a change to this file alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

    from inlinelm import Engine
    from inlinelm.runtime.bridge import LoopBridge, OutputDispatcher
    from inlinelm.runtime.loader import LoadedEngine
    from inlinelm.sched.engine_core import EngineCore

WAIT_S = 20.0
"""Generous bound for anything that should happen soon (the machine may be loaded)."""


def loaded_or_none(engine: Engine) -> LoadedEngine | None:
    """The engine's parts (tokenizer, admission, core, grammars) while it runs, else None
    (not started yet, or closed)."""
    return engine._handle.loaded


def loaded_of(engine: Engine) -> LoadedEngine:
    """The started engine's parts (tokenizer, admission, core, grammars)."""
    loaded = loaded_or_none(engine)
    assert loaded is not None, "the engine is not started"
    return loaded


def core_of(engine: Engine) -> EngineCore:
    """The started engine's core (the engine thread's loop, its scheduler and runner)."""
    return loaded_of(engine).core


def dispatcher_of(engine: Engine) -> OutputDispatcher:
    """Where the engine thread posts each step's outputs (one bridge per event loop)."""
    return engine._dispatcher


def bridges_of(engine: Engine) -> list[LoopBridge]:
    """The engine's loop bridges, one per event loop that submitted a request."""
    return dispatcher_of(engine).bridges()


def wait_for(
    condition: Callable[[], bool],
    timeout: float = WAIT_S,
    *,
    poll_s: float = 0.005,
    what: str = "the condition",
) -> None:
    """Block until ``condition()`` holds, polling every ``poll_s``; fail after ``timeout``.

    For conditions no event announces (a server's state seen from a test thread). On an
    event loop use ``tests.runtime.helpers.wait_until``, which yields instead of blocking.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll_s)


def bound_address(server: uvicorn.Server) -> tuple[str, int]:
    """The host and port a started uvicorn server listens on (it was given port 0)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return host, port
