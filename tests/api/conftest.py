"""A real uvicorn server on 127.0.0.1 in a background thread, echo-engine apps to serve, and
the official ``openai`` client of a server.

Engines use ``runner="echo"``: no weights, deterministic answers (the prompt echoed, then
EOS), so the wire format can be pinned exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import uvicorn
from starlette.types import ASGIApp

from inlinelm.api import create_app
from inlinelm.config import EngineConfig
from inlinelm.sched.request import Request
from tests.helpers import bound_address, core_of

ECHO = EngineConfig(model="default", runner="echo", max_n=4, max_num_seqs=32)


class ServerThread:
    """Serve with uvicorn on a free port of 127.0.0.1 in a background thread until :meth:`stop`.

    ``server``: a :class:`ReadyOnStartup` server given port 0 (:meth:`of_app` makes one
    for an app). Startup is awaited on an event set by the server itself (no sleeps); a
    failed startup (the app's lifespan raised) raises here.
    """

    def __init__(self, server: ReadyOnStartup, name: str = "uvicorn-test") -> None:
        self.server = server
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def of_app(cls, app: ASGIApp, **options: Any) -> ServerThread:
        """``app`` under uvicorn's own server, its lifespan on; ``options`` are more of
        ``uvicorn.Config``'s (``loop``, ``http``)."""
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", **options
        )
        return cls(ReadyOnStartup(config))

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
    def address(self) -> tuple[str, int]:
        return bound_address(self.server)

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.address)

    def _run(self) -> None:
        try:
            self.server.run()
        finally:
            self.server.ready.set()


class ReadyOnStartup(uvicorn.Server):
    """uvicorn's server with ``ready``, set once its startup ran; a server class of its
    own gets it by listing it first (``class Ready(ReadyOnStartup, EdgeServer)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()


def serve(app: ASGIApp, **options: Any) -> Iterator[ServerThread]:
    """Run ``app`` for the duration of a fixture (``options``: see :meth:`ServerThread.of_app`)."""
    server = ServerThread.of_app(app, **options).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def openai_client(url: str, api_key: str = "unused") -> Iterator[openai.OpenAI]:
    """The ``openai`` client of the server at ``url`` (its API root: ``/v1`` is added), with
    no retries, so an error shows at once."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0) as client:
        yield client


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


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The ``openai`` client of the shared echo server."""
    with openai_client(base_url) as c:
        yield c


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
