"""``inlinelm serve``: one flag per engine option, a documented --help, and a real server."""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from inlinelm.cli import API_KEY_ENV, ENGINE_HELP, api_key, build_parser, engine_config, main
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

    assert key([], {}) is None and key([], {API_KEY_ENV: ""}) is None
    assert key([], {API_KEY_ENV: "from-env"}) == "from-env"
    assert key(["--api-key", "from-flag"], {API_KEY_ENV: "from-env"}) == "from-flag"
    args = build_parser().parse_args(["serve", "--max-fanout", "32"])
    assert args.max_fanout == 32


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


def _wait_until_serving(url: str, process: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("the server did not start")
