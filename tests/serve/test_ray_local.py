"""The local Ray instance of ``inlinelm serve --ray``: loopback only, and gone after SIGTERM.

Ray has no say over who connects to its ports but its token: whoever reaches GCS, a
raylet or a worker can run code. The real CLI starts a real local instance here; every
TCP socket its Ray processes listen on must be bound to 127.0.0.1, but for the one port
Ray Serve opens per replica on every interface (hard-coded in Ray Serve), which must
refuse a caller without Ray's token. SIGTERM (systemd, Docker, Kubernetes) must then end
the CLI and every process it started, as SIGINT does.
"""

from __future__ import annotations

import ipaddress
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from inlinelm.errors import ConfigError
from inlinelm.serve.ray_local import check_loopback_ray, local_ray_options
from tests.serve.cli_process import WAIT_S, descendants, stop
from tests.serve.ray_import import RAY_MARKS, ray
from tests.test_cli import _wait_until_serving, serve_command

pytestmark = [*RAY_MARKS, pytest.mark.timeout(600)]

SERVE_GRPC = "/ray.serve.ASGIService/HandleRequest"


def test_inlinelm_serve_ray_listens_on_loopback_only_and_sigterm_leaves_no_ray_process(
    tmp_path: Path,
) -> None:
    command, port = serve_command("--ray", "--num-threads", "1")
    with (tmp_path / "serve.log").open("w") as log:
        process = subprocess.Popen(command, stderr=log, stdout=log, text=True, cwd=tmp_path)
        started: set[psutil.Process] = set()
        try:
            _wait_until_serving(f"http://127.0.0.1:{port}", process, timeout=180)
            started = descendants(process.pid)
            sockets = listening([psutil.Process(process.pid), *started])
            exposed = [(name, ip, port) for name, ip, port in sockets if not is_loopback(ip)]
            refused = {port: refuses_without_token(port) for _, _, port in exposed}
        finally:
            returncode, alive = stop(process, signal.SIGTERM, started)
    names = {name for name, _, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets  # Ray's own servers were seen
    serve_grpc = [s for s in exposed if s[0].startswith("ray::ServeReplica")]
    assert exposed == serve_grpc, f"Ray listens beyond loopback: {exposed}"
    assert all(refused.values()), (
        f"a port on every interface takes calls without the token: {refused}"
    )
    log_text = (tmp_path / "serve.log").read_text()
    assert returncode == 0, log_text[-3000:]
    assert [p.pid for p in alive] == [], "Ray processes outlived inlinelm serve"
    assert "SIGTERM received" not in log_text


def listening(processes: Iterable[psutil.Process]) -> set[tuple[str, str, int]]:
    """``(process name, address, port)`` of every TCP socket the processes listen on."""
    found = set()
    for process in processes:
        try:
            name = process.name()
            for connection in process.net_connections(kind="tcp"):
                if connection.status == psutil.CONN_LISTEN:
                    found.add((name, connection.laddr.ip, connection.laddr.port))
        except psutil.NoSuchProcess:
            continue
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.1, or the same as an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``)."""
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip) == "127.0.0.1"


def refuses_without_token(port: int) -> bool:
    """A call to Ray Serve's per-replica gRPC server without Ray's token is UNAUTHENTICATED
    (with the token, an empty request would fail to unpickle instead)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(SERVE_GRPC)
        try:
            call(b"", timeout=WAIT_S)
        except grpc.RpcError as error:
            code: Any = error.code()  # type: ignore[attr-defined]  # a grpc.Call
            return bool(code == grpc.StatusCode.UNAUTHENTICATED)
    return False


def test_a_local_ray_that_would_listen_on_the_network_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.7")
    with pytest.raises(ConfigError, match=r"would listen on 192\.0\.2\.7"):
        check_loopback_ray()
    for loopback in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost"):
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda a=loopback: a)
        check_loopback_ray()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=disabled"):
        check_loopback_ray()


def test_a_local_ray_runs_its_dashboard_only_when_asked_and_then_on_loopback() -> None:
    assert local_ray_options(False) == {"include_dashboard": False, "dashboard_host": "127.0.0.1"}
    assert local_ray_options(True)["include_dashboard"] is True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_lands_while_serve_deploys_still_stops_the_server(
    monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    """Ray Serve's ``run`` can swallow the ``KeyboardInterrupt`` of a signal that lands while
    it waits for the app (seen: a SIGINT right after the first answer, and the CLI served on
    for good); the signal must still stop the server once ``run`` returns."""
    import inlinelm.serve.ray_local as serve_ray

    calls: list[str] = []

    def deploying(*args: object, blocking: bool = False, **kwargs: object) -> None:
        try:
            signal.raise_signal(sig)  # NOTE: delivered at once, in this (the main) thread
        except KeyboardInterrupt:
            calls.append("swallowed")  # what Ray's startup did with it
        if blocking:
            calls.append("waits for a signal already spent")  # Ray's wait_for_interrupt

    monkeypatch.setattr(serve_ray, "check_loopback_ray", lambda: None)
    monkeypatch.setattr(serve_ray.ray, "init", lambda **kwargs: calls.append("init"))
    monkeypatch.setattr(serve_ray.serve, "start", lambda **kwargs: calls.append("start"))
    monkeypatch.setattr(serve_ray.serve, "run", deploying)
    monkeypatch.setattr(serve_ray, "_stop_ray", lambda name, local: calls.append("stop"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    serve_ray.run(object(), host="127.0.0.1", port=1)  # type: ignore[arg-type]  # never deployed
    assert calls == ["init", "start", "swallowed", "stop"]
    assert {s: signal.getsignal(s) for s in before} == before
