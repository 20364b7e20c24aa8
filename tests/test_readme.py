"""README.md keeps its promises: every code block runs, every table matches the code.

- Each fenced ``python`` block runs as a file of its own in a fresh interpreter, as
  ``__main__``. A block that leaves an ``app`` behind (a Starlette app) is then served one
  chat completion through Starlette's test client, lifespan included; a Ray Serve ``app``
  is run on a local Ray instance and served one over HTTP. A block that talks
  to ``127.0.0.1:8000`` (the port ``make serve`` uses) gets a server of its own, with the
  port rewritten.
- Blocks fenced as ``python notebook`` (top-level ``await``) run in order as the cells of
  one notebook, in a real Jupyter kernel (nbclient).
- A block that builds an engine (and talks to no server) runs exactly as written, on the
  default model (the ``slow`` tests), and so do the notebook's cells. The other blocks run
  with one textual change: ``Engine(model="default"`` and ``EngineConfig(model="default"``
  gain ``runner="echo"`` (the echo runner has the default model's tokenizer and serves the
  same API); a fast test checks that every engine of the README is built that way, so the
  change would apply to each.
- ``curl`` lines in ``sh`` blocks send valid JSON with the JSON content type, and run
  against an echo server; ``inlinelm …`` lines parse with the real CLI parser.
- The options tables between ``<!-- NAME:start -->``/``<!-- NAME:end -->`` equal what
  ``python -m inlinelm.docs`` renders; the quick start is exactly ``make serve`` and
  ``make test``; relative links and anchors resolve; extras named in pip lines exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inlinelm.cli import API_KEY_ENV, build_parser
from inlinelm.docs import BLOCKS, marked_block

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVE_ADDRESS = "127.0.0.1:8000"
ECHO_TIMEOUT_S = 180
MODEL_TIMEOUT_S = 540

_FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_CONSTRUCTION = re.compile(r"\b(?:Engine|EngineConfig)\((?!EngineConfig\()")
_DEFAULT_MODEL = re.compile(r'\b(Engine|EngineConfig)\(model="default"')

# Runs a README block as __main__, then serves one request through the app it defines.
_SCRIPT_DRIVER = """
import runpy, sys
namespace = runpy.run_path(sys.argv[1], run_name="__main__")
app = namespace.get("app")
if type(app).__module__.startswith("ray.serve"):  # a Serve application: run it on local Ray
    import socket, warnings
    import httpx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import ray
        from ray import serve
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="readme", route_prefix="/")
        body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        print("serve app answered:", repr(reply.json()["choices"][0]["message"]["content"]))
    finally:
        serve.shutdown()
        ray.shutdown()
elif app is not None:
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    prefixes = [""] + [route.path for route in app.routes if isinstance(route, Mount)]
    # NOTE: a keyless router serves loopback Host names only (DNS rebinding)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        prefix = next(p for p in prefixes if client.get(p + "/v1/models").status_code == 200)
        body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        reply = client.post(prefix + "/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        print("app answered:", repr(reply.json()["choices"][0]["message"]["content"]))
"""

# Runs the cells of a JSON list as one notebook in a Jupyter kernel; fails on any error.
_NOTEBOOK_DRIVER = """
import json, sys
import nbformat
from nbclient import NotebookClient

cells = json.loads(open(sys.argv[1], encoding="utf-8").read())
notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
NotebookClient(notebook, timeout=int(sys.argv[2]), kernel_name="python3").execute()
for cell in notebook.cells:
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    assert text.strip() or not cell.outputs, cell.outputs
    print("--- cell:", repr(text))
"""


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README."""

    info: str
    code: str
    line: int

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def is_notebook(self) -> bool:
        return self.info.split()[1:] == ["notebook"]

    @property
    def needs_server(self) -> bool:
        return SERVE_ADDRESS in self.code

    @property
    def id(self) -> str:
        return f"line{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, with the line its fence opens on."""
    return [
        Block(m["info"].strip(), m["code"], text.count("\n", 0, m.start()) + 1)
        for m in _FENCE.finditer(text)
    ]


TEXT = README.read_text(encoding="utf-8")
BLOCKS_OF_README = readme_blocks(TEXT)
SCRIPTS = [b for b in BLOCKS_OF_README if b.language == "python" and not b.is_notebook]
NOTEBOOK = [b for b in BLOCKS_OF_README if b.language == "python" and b.is_notebook]
SHELL = [b for b in BLOCKS_OF_README if b.language in ("sh", "bash", "shell", "console")]


def with_echo_runner(code: str) -> str:
    """``code`` with every engine it builds on the default model switched to the echo runner."""
    code, count = _DEFAULT_MODEL.subn(r'\1(model="default", runner="echo"', code)
    assert count == len(_CONSTRUCTION.findall(code)), (
        'build every engine in README.md as Engine(model="default", ...) or '
        'EngineConfig(model="default", ...): the test switches those to the echo runner'
    )
    return code


def run_python(code: str, folder: Path, timeout_s: int) -> str:
    """Run ``code`` as a file of its own in a fresh interpreter; its output, or a failure."""
    path = folder / "block.py"
    path.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT_DRIVER, str(path)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_notebook(cells: list[str], folder: Path, timeout_s: int) -> str:
    """Run ``cells`` as one notebook in a Jupyter kernel; its output, or a failure."""
    path = folder / "cells.json"
    path.write_text(json.dumps(cells), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", _NOTEBOOK_DRIVER, str(path), str(timeout_s)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


# -- the echo server the curl lines and client blocks talk to --------------------------------


@pytest.fixture(scope="module")
def echo_server() -> Iterator[str]:
    """``inlinelm serve --runner echo`` on a free port; yields its ``host:port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "inlinelm", "serve", "--runner", "echo"]
    command += ["--port", str(port), "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # the README sends no key
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        _wait_healthy(process, address)
        yield address
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


def _wait_healthy(process: subprocess.Popen[bytes], address: str) -> None:
    deadline = time.monotonic() + ECHO_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            assert process.stderr is not None
            pytest.fail(f"the server exited: {process.stderr.read().decode()}")
        try:
            if httpx.get(f"http://{address}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail("the server did not become healthy")


# -- python blocks ------------------------------------------------------------------------------


ENGINE_SCRIPTS = [b for b in SCRIPTS if _CONSTRUCTION.search(b.code) and not b.needs_server]
# NOTE: a block run as written on the default model covers everything its echo run would
# (the same driver and checks, a fresh interpreter each: ~10 s a block, a local Ray ~30 s).
ECHO_SCRIPTS = [b for b in SCRIPTS if b not in ENGINE_SCRIPTS]


@pytest.mark.parametrize(
    "block", [*ENGINE_SCRIPTS, *NOTEBOOK], ids=[b.id for b in [*ENGINE_SCRIPTS, *NOTEBOOK]]
)
def test_every_engine_of_a_block_is_built_on_the_default_model(block: Block) -> None:
    """The blocks that run as written would switch to the echo runner as the others do
    (:func:`with_echo_runner` fails for an engine it would not switch)."""
    with_echo_runner(block.code)


@pytest.mark.parametrize("block", ECHO_SCRIPTS, ids=[b.id for b in ECHO_SCRIPTS])
def test_python_block_runs_with_the_echo_runner(
    block: Block, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    code = with_echo_runner(block.code)
    if block.needs_server:
        code = code.replace(SERVE_ADDRESS, request.getfixturevalue("echo_server"))
    print(run_python(code, tmp_path, ECHO_TIMEOUT_S))


@pytest.mark.slow
@pytest.mark.timeout(MODEL_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", ENGINE_SCRIPTS, ids=[b.id for b in ENGINE_SCRIPTS])
def test_python_block_runs_as_written_on_the_default_model(block: Block, tmp_path: Path) -> None:
    output = run_python(block.code, tmp_path, MODEL_TIMEOUT_S)
    print(output)
    assert output.strip()


@pytest.mark.slow
@pytest.mark.timeout(MODEL_TIMEOUT_S + 120)
def test_notebook_blocks_run_as_written_on_the_default_model(tmp_path: Path) -> None:
    assert NOTEBOOK, "README.md has no ```python notebook block"
    print(run_notebook([b.code for b in NOTEBOOK], tmp_path, MODEL_TIMEOUT_S))


# -- shell blocks -------------------------------------------------------------------------------


def shell_commands(prefix: str) -> list[list[str]]:
    """The commands of the README's shell blocks whose first word is ``prefix``, as argv."""
    commands = []
    for block in SHELL:
        for line in block.code.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == prefix:
                commands.append(argv)
    return commands


CURLS = shell_commands("curl")


def test_the_readme_shows_curl_and_the_openai_client() -> None:
    assert CURLS and any("from openai import" in b.code for b in SCRIPTS)


@pytest.mark.parametrize("argv", CURLS, ids=[f"curl{i}" for i in range(len(CURLS))])
def test_curl_line_sends_json_and_gets_an_answer(argv: list[str], echo_server: str) -> None:
    headers = [argv[i + 1].lower() for i, a in enumerate(argv) if a in ("-H", "--header")]
    bodies = [argv[i + 1] for i, a in enumerate(argv) if a in ("-d", "--data")]
    if bodies:
        (body,) = bodies
        data = json.loads(body)
        assert "max_tokens" in data, "give every README request a max_tokens"
        assert "content-type: application/json" in headers, "the server answers 415 without it"
    if shutil.which("curl") is None:
        pytest.skip("needs curl to run the line (its JSON was checked)")
    command = [a.replace(SERVE_ADDRESS, echo_server) if a.startswith("http") else a for a in argv]
    command[1:1] = ["-sS", "--fail-with-body", "--max-time", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    if bodies and data.get("stream"):
        events = [line[6:] for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all("choices" in json.loads(e) for e in events[:-1])
    else:
        assert "error" not in json.loads(done.stdout)


def test_inlinelm_lines_parse_with_the_cli() -> None:
    lines = shell_commands("inlinelm")
    assert lines, "README.md shows no inlinelm command line"
    parser = build_parser()
    for argv in lines:
        parser.parse_args(argv[1:])


def test_quick_start_is_make_serve_and_make_test() -> None:
    section = TEXT.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    first = readme_blocks(section)[0]
    commands = [shlex.split(line, comments=True) for line in first.code.splitlines()]
    assert [" ".join(c) for c in commands if c] == ["make serve", "make test"]


def test_extras_named_in_install_lines_exist() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = pyproject["project"]["optional-dependencies"]
    named = re.findall(r"inlinelm\[([\w,-]+)\]", TEXT)
    assert named
    for group in named:
        for extra in group.split(","):
            assert extra in extras, extra


# -- generated tables, links ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BLOCKS))
def test_generated_table_matches_the_code(name: str) -> None:
    block = marked_block(TEXT, name)
    assert block is not None, f"README.md lacks <!-- {name}:start --> / <!-- {name}:end -->"
    assert block == BLOCKS[name](), "stale table: run `python -m inlinelm.docs readme`"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_anchors_resolve() -> None:
    prose = _FENCE.sub("", TEXT)
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", prose, re.MULTILINE)}
    links = re.findall(r"\]\(([^)\s]+)\)", TEXT)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (ROOT / path).exists(), link
        else:
            assert anchor in anchors, link
