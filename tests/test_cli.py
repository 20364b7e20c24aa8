"""``inlinelm serve``: one flag per engine option, a documented --help, and a real server."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from inlinelm import cli
from inlinelm.api.edge_limits import EdgeLimits
from inlinelm.cli import (
    API_KEY_ENV,
    api_key,
    build_parser,
    edge_limits,
    engine_config,
    main,
)
from inlinelm.cli_models import engine_configs, served_models
from inlinelm.cli_options import ENGINE_HELP
from inlinelm.config import EngineConfig
from inlinelm.runtime.engine import Engine
from tests.conftest import TOKENIZER_FILES
from tests.gpu.loading.bad_gguf import tiny_gguf_parts, write_gguf


def test_every_engine_option_is_a_documented_flag() -> None:
    text = build_parser().format_help()
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert f.name in ENGINE_HELP, f"give --{flag} a help text in ENGINE_HELP"
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--max-request-bytes",
        "--sse-ping-s",
        "--max-fanout",
        "--api-key",
        "--allowed-hosts",
        "--max-header-bytes",
        "--request-timeout-s",
        "--keep-alive-timeout-s",
        "--max-connections",
        "--ray-dashboard",
    ):
        assert flag in text


def test_flags_build_the_engine_config_and_unset_flags_keep_its_defaults() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--runner",
            "echo",
            "--max-n",
            "3",
            "--no-enable-prefix-caching",
            "--max-queue-wait-s",
            "1.5",
            "--port",
            "9",
        ]
    )
    config = engine_config(args)
    assert (config.runner, config.max_n, config.enable_prefix_caching, config.max_queue_wait_s) == (
        "echo",
        3,
        False,
        1.5,
    )
    assert config.max_num_seqs == EngineConfig().max_num_seqs and config.model == "default"
    assert args.port == 9 and args.host == "127.0.0.1"


@pytest.mark.parametrize(("flag", "expected"), [("256MiB", 256 * 2**20), ("1000", 1000)])
def test_the_kv_cache_budget_flag_takes_a_size(flag: str, expected: int) -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-bytes", flag])
    assert engine_config(args).kv_cache_budget == expected


def test_the_api_key_comes_from_the_flag_else_the_environment() -> None:
    def key(argv: list[str], environ: dict[str, str]) -> str | None:
        return api_key(build_parser().parse_args(["serve", *argv]), environ)

    assert key([], {}) is None
    assert key([], {API_KEY_ENV: "from-env"}) == "from-env"
    assert key(["--api-key", "from-flag"], {API_KEY_ENV: "from-env"}) == "from-flag"
    args = build_parser().parse_args(["serve", "--max-fanout", "32"])
    assert args.max_fanout == 32


def test_the_edge_flags_build_the_limits_with_sane_defaults() -> None:
    assert edge_limits(build_parser().parse_args(["serve"])) == EdgeLimits()
    args = build_parser().parse_args(
        [
            "serve",
            "--max-header-bytes",
            "2048",
            "--request-timeout-s",
            "2.5",
            "--keep-alive-timeout-s",
            "1",
            "--max-connections",
            "0",
            "--allowed-hosts",
            "my.app, *.example.com",
        ]
    )
    assert edge_limits(args) == EdgeLimits(2048, 2.5, 1.0, None)  # 0: no bound
    assert args.allowed_hosts == ["my.app", "*.example.com"]
    assert build_parser().parse_args(["serve"]).allowed_hosts is None


def test_the_parser_and_chat_template_flags_reach_the_engine_and_the_app(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import inlinelm.api

    class Made(Exception):
        pass

    seen: dict[str, object] = {}

    def create_app(engine: Any, **options: object) -> None:
        seen.update(options, config=engine.config)
        raise Made

    monkeypatch.setattr(inlinelm.api, "create_app", create_app)
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(
        [
            "serve",
            "--runner",
            "echo",
            "--reasoning-parser",
            "qwen3",
            "--tool-parser",
            "hermes",
            "--chat-template",
            str(template),
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
        ]
    )
    with pytest.raises(Made):
        cli.serve(args)
    config = seen["config"]
    assert isinstance(config, EngineConfig)
    assert config.reasoning_parser == "qwen3" and seen["tool_parser"] == "hermes"
    assert config.chat_template == str(template)
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    defaults = engine_config(build_parser().parse_args(["serve"]))
    assert defaults.reasoning_parser == "auto" and defaults.chat_template is None


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--api-key", ""], {}, "--api-key is empty"),
        (["--api-key", " "], {API_KEY_ENV: "fine"}, "--api-key is empty"),
        ([], {API_KEY_ENV: ""}, f"${API_KEY_ENV} is empty"),
        ([], {API_KEY_ENV: "key\n"}, "starts or ends with whitespace"),
    ],
)
def test_an_empty_api_key_is_one_line_and_a_failure_never_no_key(
    argv: list[str],
    environ: dict[str, str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    assert main(["serve", "--runner", "echo", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("inlinelm serve: error: ") and message in err


def _must_not_serve(args: object) -> int:
    raise AssertionError("the server started")


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--runner", "gpu"],
        ["serve", "--max-n", "many"],
        ["serve", "--nope"],
        ["serve", "--kv-cache-bytes", "lots"],
        ["serve", "--reasoning-parser", "r2"],
        ["serve", "--default-chat-template-kwargs", "[1]"],
        ["serve", "--default-chat-template-kwargs", "{nope"],
        ["serve", "--tool-parser", "xml"],
    ],
)
def test_bad_flags_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "bad"),
    [
        (["serve", "--mod", "/x"], "--mod /x"),  # an abbreviation of --model
        (["serve", "--max-num", "3"], "--max-num 3"),
        (["serve", "--bogus"], "--bogus"),
    ],
)
def test_unknown_and_abbreviated_flags_get_the_serve_usage(
    argv: list[str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: inlinelm serve")
    assert f"inlinelm serve: error: unrecognized arguments: {bad}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--model", "/nope"], "model '/nope' does not exist"),
        (["serve", "--runner", "echo", "--max-num-seqs", "0"], "max_num_seqs must be a positive"),
        (["serve", "--device", "tpu"], "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (["serve", "--replicas", "2"], "--replicas and --routing need --ray"),
        (["serve", "--routing", "serve"], "--replicas and --routing need --ray"),
        (["serve", "--ray", "--replicas", "0"], "--replicas must be at least 1"),
        (["serve", "--ray-dashboard"], "--ray-dashboard needs --ray"),
        (["serve", "--runner", "echo", "--request-timeout-s", "0"], "request_timeout_s must be"),
        (["serve", "--runner", "echo", "--max-header-bytes", "10"], "max_header_bytes must be"),
    ],
)
def test_a_model_or_option_that_cannot_work_is_one_line_and_a_failure(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("inlinelm serve: error: ") and message in err
    assert "Traceback" not in err


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"inlinelm {importlib.metadata.version('inlinelm')}\n"


def test_serve_help_states_each_default_once() -> None:
    text = _serve_parser().format_help()
    # One block per flag: its line and the indented help lines under it.
    blocks = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[1])
    assert len(blocks) > 60
    for block in blocks:
        assert block.count("default:") <= 1, block


def _serve_parser() -> Any:
    args = build_parser().parse_args(["serve"])
    return args.command_parser


@pytest.mark.parametrize(
    ("flags", "suggestion"),
    [
        (["--max-num-seq", "3"], "--max-num-seqs"),
        (["--max_num_seq", "3"], "--max-num-seqs"),  # vLLM's spelling, misspelt
        (["--enable-prefix-cache"], "--enable-prefix-caching"),
        (["--prot", "9"], "--port"),
    ],
)
def test_a_misspelt_flag_gets_a_did_you_mean(
    flags: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert info.value.code == 2
    assert f"; did you mean '{suggestion}'?" in capsys.readouterr().err


def test_vllm_underscore_spellings_are_the_dashed_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(cli, "serve", lambda args: seen.append(args) or 0)
    argv = ["serve", "--runner", "echo", "--max_num_seqs", "8", "--max_model_len=512"]
    argv += ["--no-enable_prefix_caching", "--served_model_name", "a_b", "--port", "0"]
    assert main(argv) == 0
    (args,) = seen
    config = engine_config(args)
    assert (config.max_num_seqs, config.max_model_len, config.enable_prefix_caching) == (
        8,
        512,
        False,
    )
    assert args.served_model_name == "a_b"  # a value keeps its underscores


def _serve_args(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


def test_several_models_each_get_every_engine_flag_and_a_name() -> None:
    args = _serve_args("--model", "chat=default", "--model", "small=default", "--max-num-seqs", "8")
    configs = engine_configs(args)
    assert list(configs) == ["chat", "small"]
    assert all(c.model == "default" and c.max_num_seqs == 8 for c in configs.values())
    assert engine_config(args) == configs["chat"]  # the first model's


def test_a_model_without_a_name_is_served_under_its_own(tmp_path: Path) -> None:
    folder = tmp_path / "run=3"  # an existing path is a model, '=' or not
    folder.mkdir()
    argv = ["--model", "/models/qwen.gguf", "--model", "default", "--model", str(folder)]
    assert served_models(_serve_args(*argv)) == {
        "qwen.gguf": "/models/qwen.gguf",
        "default": "default",
        "run=3": str(folder),
    }
    for model in served_models(_serve_args(*argv)).values():
        assert Engine(model=model).model_name in served_models(_serve_args(*argv))
    assert served_models(_serve_args()) == {"default": "default"}
    assert served_models(_serve_args("--served-model-name", "smol")) == {"smol": "default"}
    assert served_models(_serve_args("--model", "smol=default")) == {"smol": "default"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "default", "--model", "default"], "two models are served as 'default'"),
        (["--model", "a/m.gguf", "--model", "b/m.gguf"], "two models are served as 'm.gguf'"),
        (["--model", "a=default", "--model", "b/a"], "two models are served as 'a'"),
        (
            ["--model", "a=default", "--model", "b=default", "--served-model-name", "c"],
            "--served-model-name names a single model",
        ),
        (["--model", "a=default", "--model", "b=default", "--ray"], "--ray serves a single model"),
        (["--model", "=default"], "give both NAME and MODEL"),
        (["--model", "a="], "give both NAME and MODEL"),
        (["--model", "a=default", "--served-model-name", "b"], "the model is named twice"),
    ],
)
def test_models_that_cannot_be_served_together_exit_with_usage(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--runner", "echo", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: inlinelm serve") and "inlinelm serve: error: " in err
    assert message in err


def test_every_model_is_checked_before_anything_loads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    assert main(["serve", "--model", "default", "--model", "b=/nope", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model '/nope' does not exist" in err


def test_several_models_make_one_app_of_several_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    import inlinelm.api

    class Made(Exception):
        pass

    seen: dict[str, Any] = {}

    def create_app(engines: Any, **options: object) -> None:
        seen.update(options, engines=engines)
        raise Made

    monkeypatch.setattr(inlinelm.api, "create_app", create_app)
    args = _serve_args("--runner", "echo", "--model", "a=default", "--model", "b=default")
    with pytest.raises(Made):
        cli.serve(args)
    engines = seen["engines"]
    assert list(engines) == ["a", "b"] and seen["model_name"] is None
    assert all(isinstance(e, Engine) and e.config.runner == "echo" for e in engines.values())
    with pytest.raises(Made):
        cli.serve(_serve_args("--runner", "echo", "--model", "a=default"))
    assert isinstance(seen["engines"], Engine) and seen["model_name"] == "a"


@pytest.fixture
def listening() -> Iterator[int]:
    """A port of 127.0.0.1 another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_one_line_before_the_model_loads(
    listening: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    assert main(["serve", "--runner", "echo", "--port", str(listening)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"inlinelm serve: error: 127.0.0.1:{listening} is in use (another server listens "
        "there); pick another --port\n"
    )


@pytest.mark.parametrize("port", ["80000", "-1", "65536"])
def test_a_port_out_of_range_is_one_line(
    port: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    assert main(["serve", "--runner", "echo", "--port", port]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"inlinelm serve: error: --port must be 1 to 65535 (or 0: any free port), got {port}\n"
    )


def _tiny_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    return {**config, **changes}


def _folder(path: Path, config: dict[str, Any], tokenizer_dir: Path | None) -> Path:
    """A model folder: config.json, a weight file (never read: the checks must not), and
    the real tokenizer's files when ``tokenizer_dir`` is given."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not read")
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def test_an_unsupported_architecture_is_one_line_before_anything_loads(
    tmp_path: Path,
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    gemma = _folder(tmp_path / "gemma", _tiny_config(model_type="gemma"), tokenizer_dir)
    gguf = write_gguf(tmp_path / "gpt2.gguf", replace(tiny_gguf_parts(), arch="gpt2"))
    for model, message in [
        (gemma, "unsupported architecture 'gemma'; supported: llama, mistral, qwen2"),
        (gguf, "unsupported GGUF architecture 'gpt2'; supported: llama, qwen2"),
    ]:
        assert main(["serve", "--model", str(model), "--port", "0"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("inlinelm serve: error: "), err
        assert message in err and str(model) in err


def test_a_model_without_a_tokenizer_is_one_line_before_anything_loads(
    tmp_path: Path,
    tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "serve", _must_not_serve)
    bare = _folder(tmp_path / "bare", _tiny_config(), None)
    half = _folder(tmp_path / "half", _tiny_config(), None)
    (half / "vocab.json").write_text("{}")  # a BPE vocabulary without its merges.txt
    for model, flags in [(bare, []), (half, []), (bare, ["--tokenizer", str(half)])]:
        assert main(["serve", "--model", str(model), "--port", "0", *flags]) == 1
        err = capsys.readouterr().err
        folder = flags[-1] if flags else str(model)
        assert err.startswith(f"inlinelm serve: error: no tokenizer in {folder}; pass tokenizer=")
        assert err.count("\n") == 1
    good = _folder(tmp_path / "good", _tiny_config(), tokenizer_dir)
    monkeypatch.setattr(cli, "serve", lambda args: 0)
    assert main(["serve", "--model", str(bare), "--tokenizer", str(good), "--port", "0"]) == 0


def serve_command(*flags: str) -> tuple[list[str], int]:
    """``python -m inlinelm serve --runner echo --port P FLAGS``, with a free port P."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = [sys.executable, "-m", "inlinelm", "serve", "--runner", "echo"]
    return [*serve, "--port", str(port), *flags], port


def test_python_m_inlinelm_serve_streams_a_chat_and_logs_each_request() -> None:
    command, port = serve_command("--log-level", "info")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_serving(url, process)
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 5,
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3  # role, text (+ finish), done
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    (log,) = [line for line in stderr.splitlines() if "request chatcmpl-" in line]
    assert "prompt_tokens=" in log and "output_tokens=5" in log and "ttft=" in log and "e2e=" in log
    assert "finish=length" in log


def test_python_m_inlinelm_serve_serves_two_models_by_name() -> None:
    command, port = serve_command("--model", "chat=default", "--model", "small=default")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_serving(url, process)
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        body = {"prompt": "one two", "max_tokens": 2}
        replies = [
            httpx.post(f"{url}/v1/completions", json={**body, "model": m}, timeout=30)
            for m in ("small", "gpt-4o")
        ]
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert [m["id"] for m in models] == ["chat", "small"]
    assert replies[0].json()["model"] == "small" and replies[0].json()["choices"][0]["text"]
    assert replies[1].status_code == 404


def test_ctrl_c_mid_stream_ends_it_with_an_error_event_then_done_then_stops() -> None:
    command, port = serve_command("--echo-step-s", "0.05")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_serving(url, process)
        body = {"prompt": "x y", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = []
            for line in response.iter_lines():
                if line and not lines:
                    process.send_signal(signal.SIGINT)  # once the stream has begun
                lines += [line] if line else []
        assert lines[-1] == "data: [DONE]" and len(lines) < 200  # ended, not finished
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert (error["code"], error["message"]) == ("engine_closed", "the server is shutting down")
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "finish=engine_closed" in stderr  # the request's log line


def test_the_server_logs_whether_a_key_is_set_and_never_the_key() -> None:
    command, port = serve_command("--log-level", "info")
    environ = {**os.environ, API_KEY_ENV: "sk-secret-value"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environ)
    try:
        _wait_until_serving(f"http://127.0.0.1:{port}", process)  # /health needs no key
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert f"API key: set (from ${API_KEY_ENV})" in stderr
    assert "sk-secret-value" not in stderr


def test_a_model_that_fails_to_load_at_start_is_one_line_and_a_failure(tmp_path: Path) -> None:
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 16)  # the magic, then garbage
    command, _ = serve_command("--model", str(model))
    command[command.index("echo")] = "model"  # NOTE: the real runner, so the model loads
    environ = {**os.environ, "INLINELM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [errors[0]] and errors[0].startswith("inlinelm serve: error: ")
    assert "broken.gguf" in errors[0] and "Traceback" not in done.stderr
    assert done.stderr.endswith(errors[0] + "\n")  # nothing after it: no lifespan report


def _wait_until_serving(url: str, process: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("the server did not start")
