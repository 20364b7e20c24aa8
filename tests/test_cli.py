"""``inlinelm serve``: one flag per engine option, a documented --help, and a real server."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inlinelm import cli
from inlinelm.api.edge_limits import EdgeLimits
from inlinelm.cli import (
    API_KEY_ENV,
    ENGINE_HELP,
    api_key,
    build_parser,
    edge_limits,
    engine_config,
    main,
)
from inlinelm.config import EngineConfig


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
    "argv", [["serve", "--runner", "gpu"], ["serve", "--max-n", "many"], ["serve", "--nope"]]
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
