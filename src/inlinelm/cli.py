"""``inlinelm serve``: the OpenAI-compatible server on uvicorn, one flag per engine option.

The flags are :mod:`inlinelm.cli_options`'s; what can be wrong with them, the address, the
models or their tokenizers is found by :mod:`inlinelm.cli_checks` before anything loads.
``--model`` may be repeated (``--model chat=/models/a --model b.gguf``): one server serves
every model, each under its name. An empty API key is an error, never "no key". Anything
that cannot work, found before or while the server starts (an option, a port in use, a
model that does not load), is one line on stderr and exit status 1; a flag argparse does
not know, or flags that cannot go together, are the usage and 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from inlinelm.api.access import LOOPBACK_HOSTS, host_name
from inlinelm.cli_checks import check_serve
from inlinelm.cli_models import UsageError, engine_config, engine_configs, served_models
from inlinelm.cli_options import (
    API_KEY_ENV,
    api_key,
    build_parser,
    dashed_flags,
    edge_limits,
    flag_names,
    key_source,
    unknown_flags_message,
)
from inlinelm.errors import InlineLMError

RAY_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

logger = logging.getLogger("inlinelm.cli")


def main(argv: Sequence[str] | None = None) -> int:
    """The ``inlinelm`` command; returns the exit status.

    Usage errors (an unknown or abbreviated flag, with a "did you mean" when one is close;
    two models under one name) print the sub-command's usage and exit with 2; vLLM's
    underscore spellings of the flags are taken as the dashed ones. An option, address,
    key or model that cannot work, found before the server starts or while it starts (a
    model that fails to load), prints one line and exits with 1.
    """
    parser = build_parser()
    flags = flag_names(parser)
    given = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(dashed_flags(given, flags))
    command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
    if extra:
        command_parser.error(unknown_flags_message(extra, flags))
    if args.command == "serve":
        try:
            served_models(args)
            check_serve(args)
            return serve(args)
        except UsageError as e:
            command_parser.error(str(e))
        except InlineLMError as e:
            print(f"{command_parser.prog}: error: {e}", file=sys.stderr)
            return 1
    parser.print_help()
    return 2


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn on :func:`~inlinelm.api.create_app` until interrupted (or Ray Serve).

    One engine per ``--model``, served under its name. The engines start (in order)
    before the server binds its port; an ``InlineLMError`` on the way (a model that does
    not load) is raised here, for :func:`main` to print in one line, once every engine is
    closed.
    """
    from inlinelm.api import create_app
    from inlinelm.api.edge import EdgeServer, server_config
    from inlinelm.runtime.engine import Engine

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log_access(args, os.environ)
    if args.ray:
        return serve_on_ray(args)
    engines = {name: Engine(config) for name, config in engine_configs(args).items()}
    # NOTE: one model is served as a single engine, as it always was (app.state.engine).
    single = len(engines) == 1
    app = create_app(
        next(iter(engines.values())) if single else engines,
        model_name=next(iter(engines)) if single else None,
        max_request_bytes=args.max_request_bytes,
        sse_ping_s=args.sse_ping_s,
        max_fanout=args.max_fanout,
        api_key=api_key(args, os.environ),
        allowed_hosts=args.allowed_hosts,
        tool_parser=args.tool_parser,
    )
    limits = edge_limits(args)
    config = server_config(
        app, host=args.host, port=args.port, limits=limits, log_level=args.log_level
    )
    # NOTE: uvloop and httptools: the loop keeps up with hundreds of streams (benchmarks/README.md).
    server = EdgeServer(config, list(engines.values()), limits)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        # NOTE: the lifespan closed them, unless a start failed or was cut short
        for engine in engines.values():
            engine.close()
    if server.startup_error is not None:
        raise server.startup_error
    return 0


def serve_on_ray(args: argparse.Namespace) -> int:
    """``serve --ray``: :func:`~inlinelm.serve.ray.build_app` run until interrupted (one
    model: :func:`~inlinelm.cli_models.served_models` refuses several with ``--ray``).

    Without ``$RAY_ADDRESS`` the local Ray instance must listen on loopback only; Ray
    decides that when it is imported, from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, so the
    variable is set here, before the import (``run`` refuses a local instance without it).
    """
    if not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault(RAY_LOCAL_ONLY_ENV, "0")
    from inlinelm.serve.ray import ApiOptions, build_app, run

    ((name, model),) = served_models(args).items()
    api = ApiOptions(
        model_name=name,
        max_request_bytes=args.max_request_bytes,
        sse_ping_s=args.sse_ping_s,
        max_fanout=args.max_fanout,
        api_key=api_key(args, os.environ),
        allowed_hosts=None if args.allowed_hosts is None else tuple(args.allowed_hosts),
        tool_parser=args.tool_parser,
    )
    app = build_app(
        engine_config(args, model), num_replicas=args.replicas, routing=args.routing, api=api
    )
    run(app, host=args.host, port=args.port, dashboard=args.ray_dashboard)
    return 0


def log_access(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Log who may call the server: whether a key is set and where from (never the key),
    and which hosts a server without one serves; a warning when such a server listens
    beyond loopback."""
    source = key_source(args, environ)
    if source is not None:
        logger.info("API key: set (from %s); every endpoint but /health needs it", source)
        return
    hosts = sorted(LOOPBACK_HOSTS | set(args.allowed_hosts or ()))
    logger.info("API key: none; requests naming these hosts are served: %s", ", ".join(hosts))
    if host_name(args.host) not in LOOPBACK_HOSTS:
        logger.warning(
            "listening on %s without an API key: anyone who reaches the port may use the "
            "API (set --api-key or $%s)",
            args.host,
            API_KEY_ENV,
        )
