"""What ``inlinelm serve`` checks before it loads anything.

A mistake found here costs milliseconds, where the same mistake found by the server would
cost the model's load (seconds, gigabytes): the options, the API key, the address to
listen on (bound and released at once), each model's architecture (its config.json or its
GGUF header, never its weights), its tokenizer's files, and the device. Each is a
``ConfigError`` or ``ModelLoadError`` for ``main`` to print in one line.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import socket
from pathlib import Path

from inlinelm.cli_models import engine_configs
from inlinelm.cli_options import api_key, edge_limits
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.gpu.loading.model_files import check_model, check_tokenizer_files, default_model_path

MAX_PORT = 65535


def check_serve(args: argparse.Namespace) -> None:
    """What ``serve`` can know is wrong before it starts the server: the options, the
    address and the device (``ConfigError``), each model and its tokenizer
    (``ModelLoadError``); nothing is loaded."""
    from inlinelm.runtime.loader import check_device

    if not args.ray and (args.replicas != 1 or args.routing != "prefix"):
        raise ConfigError("--replicas and --routing need --ray", option="ray")
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {args.replicas}", option="replicas")
    if args.ray:
        check_ray()
    elif args.ray_dashboard:
        raise ConfigError("--ray-dashboard needs --ray", option="ray_dashboard")
    api_key(args, os.environ)
    edge_limits(args)
    configs = list(engine_configs(args).values())
    # NOTE: on a Ray cluster ($RAY_ADDRESS) Serve's proxy listens there, not here.
    check_address(args.host, args.port, bind=not (args.ray and os.environ.get("RAY_ADDRESS")))
    for config in configs:
        if config.runner == "echo" and config.model == "default":
            continue
        check_model_files(config)
        if config.runner == "model":
            check_device(config.device)


def check_ray() -> None:
    """``--ray`` without Ray Serve installed is a ``ConfigError`` naming the extra."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--ray needs Ray Serve: pip install 'inlinelm[ray]'", option="ray")


def check_address(host: str, port: int, *, bind: bool = True) -> None:
    """A ``ConfigError`` for a port outside 0..65535 (0: any free port) and, with ``bind``,
    for a ``host:port`` this process cannot listen on (in use, not this machine's, a
    privileged port): each address the host resolves to is bound as uvicorn binds it,
    then released at once."""
    if not 0 <= port <= MAX_PORT:
        raise ConfigError(
            f"--port must be 1 to {MAX_PORT} (or 0: any free port), got {port}", option="port"
        )
    if not bind or port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} does not resolve: {e.strerror}", option="host") from e
    bound = 0
    for family, kind, proto, _, address in infos:
        try:
            _bind_and_release(family, kind, proto, address)
        except OSError as e:
            # NOTE: as asyncio's create_server: an address of a family this machine has
            # not enabled (::1 without IPv6) is skipped.
            if e.errno == errno.EADDRNOTAVAIL and len(infos) > 1:
                continue
            raise ConfigError(_bind_error(host, port, e), option="port") from e
        bound += 1
    if not bound:
        raise ConfigError(f"cannot listen on {_show(host, port)}: no usable address", option="host")


def check_model_files(config: EngineConfig) -> None:
    """The model's files and the tokenizer's, without reading a weight: the default
    model's package, a folder's config.json (its architecture) and weight files, a GGUF
    file's header (its architecture, sizes and tokenizer keys), and the tokenizer folder
    (``tokenizer=``, else the model's folder). Raises ``ModelLoadError``."""
    folder: Path | None = None
    if config.model == "default":
        default_model_path()
    else:
        path = check_model(config.model)
        folder = path if path.is_dir() else None
    tokenizer = Path(config.tokenizer).expanduser() if config.tokenizer else folder
    if tokenizer is not None:
        check_tokenizer_files(tokenizer)


def _bind_and_release(
    family: socket.AddressFamily, kind: socket.SocketKind, proto: int, address: tuple[object, ...]
) -> None:
    with socket.socket(family, kind, proto) as sock:
        # NOTE: the options asyncio's create_server sets: a port held only by closed
        # connections (TIME_WAIT) is free, and an IPv6 socket does not claim IPv4 too.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)


def _bind_error(host: str, port: int, error: OSError) -> str:
    where = _show(host, port)
    if error.errno == errno.EADDRINUSE:
        return f"{where} is in use (another server listens there); pick another --port"
    if error.errno == errno.EACCES and port < 1024:
        return f"cannot listen on {where}: ports below 1024 need privileges; pick another --port"
    return f"cannot listen on {where}: {error.strerror}"


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
