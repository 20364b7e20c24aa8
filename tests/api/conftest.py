"""A real uvicorn server on 127.0.0.1 in a background thread, and echo-engine apps to serve.

Engines use ``runner="echo"``: no weights, deterministic answers (the prompt echoed, then
EOS), so the wire format can be pinned exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.types import ASGIApp

from inlinelm.api import create_app
from inlinelm.config import EngineConfig
from inlinelm.sched.request import Request
from tests.helpers import core_of

ECHO = EngineConfig(model="default", runner="echo", max_n=4, max_num_seqs=32)


class ServerThread:
    """Serve ``app`` with uvicorn on a free port of 127.0.0.1 until :meth:`stop`.

    Startup is awaited on an event set by the server itself (no sleeps); a failed startup
    (the app's lifespan raised) raises here.
    """

    def __init__(self, app: ASGIApp) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = _Server(config)
        self.thread = threading.Thread(target=self._run, name="uvicorn-test", daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        self.server.ready.wait(timeout=60)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        socket = self.server.servers[0].sockets[0]
        host, port = socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def _run(self) -> None:
        try:
            self.server.run()
        finally:
            self.server.ready.set()


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def serve(app: ASGIApp) -> Iterator[ServerThread]:
    """Run ``app`` for the duration of a fixture."""
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def echo_app() -> Any:
    """One echo-engine app shared by the read-only tests (its engine is ``app.state.engine``)."""
    return create_app(ECHO)


@pytest.fixture(scope="session")
def echo_server(echo_app: Any) -> Iterator[ServerThread]:
    yield from serve(echo_app)


@pytest.fixture(scope="session")
def base_url(echo_server: ServerThread) -> str:
    return echo_server.url


@pytest.fixture
def submitted(echo_app: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the engine calls that submit requests (``stream``, ``chat``), as made."""
    engine = echo_app.state.engine
    calls: list[str] = []
    for name in ("stream", "chat"):
        monkeypatch.setattr(engine, name, _recording(getattr(engine, name), name, calls))
    return calls


@pytest.fixture
def queued(echo_app: Any, echo_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the requests handed to the echo engine's thread, as handed."""
    core = core_of(echo_app.state.engine)
    ids: list[str] = []
    add = core.add_request

    def record(request: Request) -> None:
        ids.append(request.request_id)
        add(request)

    monkeypatch.setattr(core, "add_request", record)
    return ids


def _recording(call: Callable[..., Any], name: str, calls: list[str]) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return call(*args, **kwargs)

    return record
