"""Every example in ``examples/`` runs as a newcomer would run it, and prints what it should.

Scripts run in subprocesses with ``INLINELM_EXAMPLE_RUNNER=echo``: no weights, and the echo
answers a chat with the text its template put first (the system prompt, up to the first
``<|im_end|>``), so answers are known. The quick start also runs once on the real default
model. Servers listen on a free port of 127.0.0.1 and are stopped at the end; the notebook
runs headless in a real Jupyter kernel.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The echo's answer to a chat without a system message: the template's default system prompt.
ECHO_ANSWER = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def run_example(name: str, *args: str, runner: str = "echo", timeout: float = 120) -> str:
    """Run ``examples/<name>``; return its stdout then stderr (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        env=_env(runner),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@contextmanager
def serving(command: list[str], health_path: str, log: Path) -> Iterator[str]:
    """Run a server ``command`` with ``--port <free port>`` until the block ends; yield its URL.

    Startup is judged by ``health_path`` answering 200; the server must exit 0 on SIGINT.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--port", str(port)], env=_env("echo"), stdout=out, stderr=out
        )
    try:
        _wait_until_healthy(f"{url}{health_path}", process, log)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    assert process.returncode == 0, log.read_text()


def test_quickstart_streams_then_awaits_a_chat_answer() -> None:
    out = run_example("quickstart.py")
    assert out.count(ECHO_ANSWER) == 2, out
    assert "finish_reason=stop" in out and "time to first token" in out


@pytest.mark.slow
def test_quickstart_on_the_default_model() -> None:
    lines = run_example("quickstart.py", runner="model", timeout=240).strip().splitlines()
    summary = lines[-1]
    assert summary.startswith("[") and "time to first token" in summary, lines
    assert "finish_reason=stop" in summary or "finish_reason=length" in summary
    assert ECHO_ANSWER not in "\n".join(lines)  # the model wrote this, not the echo
    assert sum(1 for line in lines[:-1] if line.strip()) >= 2  # two answers, both non-empty


def test_batch_answers_100_questions() -> None:
    out = run_example("batch.py")
    assert "100 answers, 2000 tokens" in out  # 20 echoed tokens each
    assert "Q: Give one synonym for 'river'." in out and f"A: system\n{ECHO_ANSWER}" in out
    assert "100/100" not in out  # no progress bar on a stream that is not a terminal


def test_starlette_app_keeps_its_routes_and_middleware_around_the_router(
    tmp_path: Path,
) -> None:
    # As the README runs a mounted router: `uvicorn module:app`, uvicorn's own command.
    command = [sys.executable, "-m", "uvicorn", "starlette_app:app", "--app-dir", str(EXAMPLES)]
    log = tmp_path / "server.log"
    with serving(command, "/llm/health", log) as url:
        hello = httpx.get(f"{url}/hello")
        assert hello.json() == {"hello": "from the host app", "engine_ready": True}
        haiku = httpx.get(f"{url}/haiku", params={"topic": "autumn"}, timeout=30)
        assert haiku.status_code == 200 and ECHO_ANSWER in haiku.json()["haiku"]
        body = {"model": "default", "messages": [{"role": "user", "content": "Hi!"}]}
        reply = httpx.post(f"{url}/llm/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert ECHO_ANSWER in reply.json()["choices"][0]["message"]["content"]
        assert reply.headers["server-timing"].startswith("app;dur=")  # the host's middleware
    assert_engine_ready_logged(log.read_text())


def assert_engine_ready_logged(log: str) -> None:
    """The example configured logging: the engine's start shows, in one INFO line."""
    (ready,) = [line for line in log.splitlines() if "engine ready in" in line]
    assert " INFO inlinelm: " in ready and "model default on cpu" in ready, ready
    assert "KV blocks" in ready


def test_fastapi_app_serves_its_typed_endpoint_and_the_mounted_api(tmp_path: Path) -> None:
    command = [sys.executable, str(EXAMPLES / "fastapi_app.py")]
    log = tmp_path / "server.log"
    with serving(command, "/llm/health", log) as url:
        text = {"text": "inlinelm runs the model on one thread inside your process."}
        summary = httpx.post(f"{url}/summarize", json=text, timeout=30)
        assert summary.status_code == 200, summary.text
        # The echo repeats the example's own system message.
        assert summary.json()["summary"] == "system\nSummarize the user's text in one sentence."
        assert summary.json()["finish_reason"] == "stop"
        assert httpx.post(f"{url}/summarize", json={"text": ""}).status_code == 422
        models = httpx.get(f"{url}/llm/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "default"
    assert_engine_ready_logged(log.read_text())


def test_openai_client_against_its_in_process_server() -> None:
    out = run_example("openai_client.py")
    assert out.count(ECHO_ANSWER) == 2, out  # the whole reply, then the streamed one
    assert "finish_reason=stop" in out


def test_openai_client_against_inlinelm_serve(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "inlinelm", "serve", "--runner", "echo"]
    with serving(command, "/health", tmp_path / "server.log") as url:
        out = run_example("openai_client.py", "--base-url", f"{url}/v1")
    assert out.count(ECHO_ANSWER) == 2, out
    assert "finish_reason=stop" in out


def test_the_notebook_is_committed_without_outputs() -> None:
    import nbformat

    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source


def test_the_notebook_runs_in_a_real_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("INLINELM_EXAMPLE_RUNNER", "echo")  # the kernel inherits it
    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=120,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    streamed = _stdout(cells[1])
    assert ECHO_ANSWER in streamed and "finish_reason=stop" in streamed
    generated = _stdout(cells[2]).splitlines()
    assert len(generated) == 8 and all(ECHO_ANSWER in line for line in generated)
    (table,) = [o for o in cells[3].outputs if o.output_type == "execute_result"]
    assert "| num_steps |" in table.data["text/markdown"]
    assert "| finished (stop) | 9 |" in table.data["text/markdown"]  # 1 stream + 8 generated
    assert any("image/png" in o.get("data", {}) for o in cells[4].outputs)


def _stdout(cell: Any) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _env(runner: str) -> dict[str, str]:
    return {**os.environ, "INLINELM_EXAMPLE_RUNNER": runner}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited:\n{log.read_text()}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # between polls of a real event, never instead of one
    raise AssertionError(f"the server did not become healthy:\n{log.read_text()}")


@pytest.mark.slow
def test_structured_example_on_the_default_model() -> None:
    """The JSON answers fit the example's schema and the forced tool call is well formed."""
    import jsonschema

    sys.path.insert(0, str(EXAMPLES))
    try:
        from structured import CITY  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES))
    out = run_example("structured.py", runner="model", timeout=300)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    python_json, _, reason = lines["python"].rpartition(" [")
    assert reason == "stop]"
    jsonschema.validate(json.loads(python_json), CITY)
    jsonschema.validate(json.loads(lines["response_format"]), CITY)
    assert lines["finish_reason"] == "tool_calls"
    assert lines["call"].startswith("get_weather {")
