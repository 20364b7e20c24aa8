"""Serving a Serve app from this process until a signal (``inlinelm serve --ray``).

:func:`run` connects to the Ray cluster at ``RAY_ADDRESS``, or starts a local instance on
this machine; a local instance must listen on loopback only and keep Ray's token
authentication (:func:`check_loopback_ray`), and runs Ray's dashboard only when asked
(:func:`local_ray_options`). SIGINT and SIGTERM stop it; what it started is then stopped
with every process of its own, under SIGINT and SIGTERM ignored.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import ray
from ray import serve

from inlinelm.errors import ConfigError

logger = logging.getLogger("inlinelm.serve")


def run(
    app: serve.Application,
    *,
    host: str,
    port: int,
    name: str = "inlinelm",
    dashboard: bool = False,
) -> None:
    """Serve ``app`` on ``host:port`` until interrupted (``inlinelm serve --ray``).

    Ray is the cluster at ``RAY_ADDRESS`` when that is set (``ray start --head`` on a
    machine, or KubeRay), else a new local instance on this machine. An interrupt, SIGINT
    or SIGTERM (what systemd, Docker and Kubernetes send), deletes the app; a local
    instance is then shut down with every process it started, a cluster's Serve is left
    running (where a Serve already runs, its own HTTP address stands and ``host``/``port``
    are not applied).

    A local instance listens on loopback only, and runs Ray's dashboard (on 127.0.0.1)
    only with ``dashboard``: anyone who reaches Ray's ports can run code in it. Ray picks
    the address its processes listen on when it is imported, from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``inlinelm serve --ray`` sets it first); in
    a process where Ray would listen on the network, a local instance is a
    ``ConfigError``, not started.
    """
    local = not os.environ.get("RAY_ADDRESS")
    if local:
        check_loopback_ray()
    stop = threading.Event()
    previous = _stop_on_signals(stop)
    try:
        ray.init(**(local_ray_options(dashboard) if local else {}))
        _stop_on_signals(stop)  # NOTE: ray.init sets a SIGTERM handler of its own
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=name, route_prefix="/", blocking=False)
        # NOTE: serve.run can swallow the KeyboardInterrupt of a signal that lands while
        # it waits for the app (it then served on, deaf to that signal): the event keeps it.
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        with _interrupts_ignored():
            _stop_ray(name, local)
        _restore_signals(previous)


def local_ray_options(dashboard: bool) -> dict[str, Any]:
    """``ray.init``'s options for a local instance: Ray's dashboard only when asked, and
    then on 127.0.0.1."""
    return {"include_dashboard": dashboard, "dashboard_host": "127.0.0.1"}


def check_loopback_ray() -> None:
    """A ``ConfigError`` unless a local Ray instance started now listens on loopback only
    and keeps Ray's token authentication.

    Ray Serve (2.60) opens one port per replica on every interface, whatever Ray's own
    address (``ray/serve/_private/replica.py``: its inter-deployment gRPC server on
    ``[::]:0``); it takes pickled calls, so only Ray's token (on by default for a local
    instance) keeps others out, and ``RAY_AUTH_MODE`` may not turn it off.
    """
    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in ray
    if not _is_loopback(address):
        raise ConfigError(
            f"a local Ray instance would listen on {address}, where anyone who reaches it "
            "can run code; set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported "
            "(inlinelm serve --ray does) for a loopback-only instance, or RAY_ADDRESS for a "
            "cluster",
            option="ray",
        )
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        raise ConfigError(
            f"RAY_AUTH_MODE={mode}: Ray Serve's replicas take calls on every interface, and "
            "without Ray's token anyone who reaches them can run code; unset RAY_AUTH_MODE",
            option="ray",
        )


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address == "localhost"
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def _stop_ray(name: str, local: bool) -> None:
    """Delete the app; with a local instance, shut Serve and Ray down (their processes end)."""
    if not ray.is_initialized():
        return
    logger.info("stopping: %s", "shutting Ray down" if local else f"deleting the app {name!r}")
    if local:
        serve.shutdown()  # type: ignore[no-untyped-call]  # unannotated in ray
    else:
        serve.delete(name)
    ray.shutdown()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals(stop: threading.Event) -> dict[int, Any] | None:
    """Make SIGINT and SIGTERM set ``stop`` and raise ``KeyboardInterrupt``; returns the old
    handlers (None off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: object) -> None:
        stop.set()
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}


def _restore_signals(previous: dict[int, Any] | None) -> None:
    for sig, old in (previous or {}).items():
        signal.signal(sig, old)


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block: a second one must not cut Ray's shutdown
    short and leave its processes running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
