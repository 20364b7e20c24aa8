"""An interrupted ``generate`` / ``generate_chat`` stops: its requests are aborted, every KV
block comes back, its progress bar is closed before the interrupt propagates, and the engine
serves the next call. Along both paths of ``run_sync``: a script (``asyncio.run``) and a
running loop (a Jupyter cell: the helper thread), interrupted by ``_thread.interrupt_main()``
and by a real SIGINT, while running and while the engine starts; on the helper path also
twice, and with a helper that does not finish in time. And in a real kernel through
nbclient, which also shows no "IProgress not found" warning without ipywidgets.

The script and loop cases run in an interpreter of their own (:func:`child`), so an
interrupt that lands late can never hit the test runner. Waits are on events, or on a
condition polled against a deadline.
"""

from __future__ import annotations

import _thread
import asyncio
import importlib.util
import io
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from inlinelm import Engine

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 20.0
ECHO_STEP_S = 0.01
ENDLESS: dict[str, Any] = {"max_tokens": 4000, "ignore_eos": True}
"""Far longer than any test waits (40 s of steps): an interrupt lands mid-request."""
CONVERSATION = [{"role": "user", "content": "Tell me a long story."}]

Call = Callable[[Engine], Any]
CALLS: dict[str, Call] = {
    "generate": lambda engine: engine.generate("an endless prompt", **ENDLESS),
    "generate_chat": lambda engine: engine.generate_chat(CONVERSATION, **ENDLESS),
}


# -- waits and interrupts ------------------------------------------------------------------


class Interrupter:
    """A thread that runs ``script`` (waits and interrupts of the main thread); its error is
    raised by :meth:`join`."""

    def __init__(self, script: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self._script = script
        self._thread = threading.Thread(target=self._run, name="test-interrupter")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._script()
        except BaseException as e:
            self.error = e

    def join(self) -> None:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the interrupter hangs"
        if self.error is not None:
            raise self.error


def sigint() -> None:
    """A real SIGINT to the main thread (what Ctrl-C and a kernel interrupt send)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


SENDERS: dict[str, Callable[[], None]] = {
    "interrupt_main": _thread.interrupt_main,
    "SIGINT": sigint,
}


def poll(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)  # NOTE: between polls of a condition the engine has no event for


def wait_event(event: threading.Event, what: str) -> None:
    assert event.wait(WAIT_S), f"timed out waiting for {what}"


# -- the tests -----------------------------------------------------------------------------


def run_child(path: str) -> str:
    """Run :func:`child` along ``path`` in a fresh interpreter; its output, or a failure."""
    code = f"from tests.runtime.test_interrupt import child; child({path!r})"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_an_interrupted_script_aborts_its_requests_and_serves_on() -> None:
    out = run_child("script")
    assert out.splitlines()[-1] == "ok", out


def test_an_interrupted_cell_aborts_its_requests_and_serves_on() -> None:
    out = run_child("loop")
    assert out.splitlines()[-1] == "ok", out


# -- a real kernel -------------------------------------------------------------------------

KERNEL_SETUP = f"""
import threading, time
from pathlib import Path
from inlinelm import Engine
from tests.runtime.helpers import is_drained

engine = Engine(runner="echo", echo_step_s={ECHO_STEP_S})
engine.start_sync()
ENDLESS = {ENDLESS!r}
CONVERSATION = {CONVERSATION!r}

def touch_when_running(marker):
    deadline = time.monotonic() + {WAIT_S}
    while engine.stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    marker.touch()

KEYS = ("num_running", "num_waiting", "num_queued", "kv_blocks_used", "num_steps")

def check_drained():
    deadline = time.monotonic() + {WAIT_S}
    while not is_drained(engine):
        assert time.monotonic() < deadline, {{k: engine.stats()[k] for k in KEYS}}
        time.sleep(0.005)
    print("drained", engine.num_free_kv_blocks == engine.num_kv_blocks)
"""

KERNEL_CALLS = {
    "generate": 'engine.generate("an endless prompt", **ENDLESS)',
    "generate_chat": "engine.generate_chat(CONVERSATION, **ENDLESS)",
}

KERNEL_AFTER = """
short = dict(max_tokens=3, ignore_eos=True, use_tqdm=False)
outs = engine.generate("served after the interrupts", **short)
chats = engine.generate_chat(CONVERSATION, **short)
print("served", len(outs[0].token_ids), len(chats[0].token_ids))
engine.close()
"""


def kernel_cells(marker: Path) -> list[tuple[str, bool]]:
    """(source, interrupted) of each cell: set up, then each call interrupted and checked."""
    cells = [(KERNEL_SETUP, False)]
    for call in KERNEL_CALLS.values():
        watch = f"threading.Thread(target=touch_when_running, args=(Path({str(marker)!r}),))"
        cells += [(f"{watch}.start()\n{call}", True), ("check_drained()", False)]
    return [*cells, (KERNEL_AFTER, False)]


def test_an_interrupted_cell_in_a_real_kernel_aborts_its_requests(tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    widgets = importlib.util.find_spec("ipywidgets") is not None  # else the text bar
    marker = tmp_path / "running"
    cells = kernel_cells(marker)
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source, _ in cells]
    )
    for cell, (_, interrupted) in zip(notebook.cells, cells, strict=True):
        if interrupted:
            cell.metadata["tags"] = ["raises-exception"]
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(ROOT)}}
    )

    def interrupt_when_running() -> None:
        poll(marker.exists, "the cell's request to run")
        marker.unlink()
        assert client.km is not None
        # NOTE: a SIGINT, as Jupyter's stop button sends; nbclient's manager is async.
        interrupt: Any = client.km.interrupt_kernel()
        asyncio.run(interrupt)

    with client.setup_kernel():
        for index, (cell, (_, interrupted)) in enumerate(zip(notebook.cells, cells, strict=True)):
            interrupter = Interrupter(interrupt_when_running) if interrupted else None
            client.execute_cell(cell, index)
            if interrupter is not None:
                interrupter.join()
    outputs = [cell.outputs for cell in notebook.cells]
    for (_, interrupted), cell_outputs in zip(cells, outputs, strict=True):
        errors = [o.ename for o in cell_outputs if o.output_type == "error"]
        assert errors == (["KeyboardInterrupt"] if interrupted else []), cell_outputs
        stderr = "".join(o.text for o in cell_outputs if o.get("name") == "stderr")
        assert "IProgress" not in stderr, stderr
        if widgets:
            continue
        if interrupted:  # NOTE: the plain text bar, closed in its own cell
            assert "generate:" in stderr and stderr.endswith("\n"), stderr
        else:
            assert "generate:" not in stderr, "a stale bar came back: " + stderr
    checks = ["".join(o.text for o in out if o.get("name") == "stdout") for out in outputs]
    assert checks[2] == checks[4] == "drained True\n", checks
    assert checks[-1] == "served 3 3\n", checks


# -- the child interpreter -----------------------------------------------------------------


class Terminal(io.StringIO):
    """A terminal's standard error (so bars draw); :meth:`hold` blocks the write that closes
    a bar until :attr:`release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def isatty(self) -> bool:
        return True

    def hold(self) -> None:
        self.release.clear()

    def write(self, text: str) -> int:
        if text == "\n":  # NOTE: tqdm's close() ends the bar's line
            self.closing.set()
            assert self.release.wait(WAIT_S), "the held bar was never released"
        return super().write(text)


def running(engine: Engine) -> bool:
    return bool(engine.stats()["num_running"] >= 1)


def assert_drained(engine: Engine) -> None:
    from tests.runtime.helpers import is_drained

    poll(lambda: is_drained(engine), "the engine to drain")
    stats = engine.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["num_queued"]) == (0, 0, 0)
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def interrupted(engine: Engine, call: Call, interrupter: Interrupter) -> KeyboardInterrupt:
    """``call(engine)``, which ``interrupter`` must interrupt; the interrupt."""
    try:
        call(engine)
    except KeyboardInterrupt as e:
        interrupter.join()
        return e
    raise AssertionError("the call was not interrupted")


def with_terminal(body: Callable[[Terminal], None]) -> Terminal:
    terminal, saved = Terminal(), sys.stderr
    sys.stderr = terminal
    try:
        body(terminal)
    finally:
        sys.stderr = saved
    return terminal


def assert_bar_closed(terminal: Terminal) -> None:
    text = terminal.getvalue()
    assert "generate:" in text and text.endswith("\n"), repr(text)


def case_interrupted_while_running(engine: Engine, call: Call, send: Callable[[], None]) -> None:
    assert_drained(engine)  # NOTE: "running" below must be this call's request

    def script() -> None:
        poll(lambda: running(engine), "the request to run")
        send()

    def body(terminal: Terminal) -> None:
        interrupted(engine, call, Interrupter(script))
        assert_bar_closed(terminal)  # NOTE: before the interrupt propagated

    terminal = with_terminal(body)
    text = terminal.getvalue()
    assert_drained(engine)
    assert terminal.getvalue() == text, "the bar came back"


def case_interrupted_while_starting(engine: Engine) -> None:
    from inlinelm.runtime.loader import load_engine as load

    loading, release, caught = threading.Event(), threading.Event(), threading.Event()

    def held_load(*args: Any) -> Any:
        loading.set()
        wait_event(release, "the release of the load")
        return load(*args)

    def script() -> None:
        wait_event(loading, "the load")
        sigint()
        wait_event(caught, "the interrupt to be caught")
        release.set()

    with mock.patch("inlinelm.runtime.engine_base.load_engine", held_load):
        interrupter = Interrupter(script)
        try:
            engine.generate("while the engine starts", max_tokens=4, use_tqdm=False)
        except KeyboardInterrupt:
            assert not engine.is_ready
            caught.set()
        interrupter.join()
    assert caught.is_set(), "the start was not interrupted"
    # The interrupt left the start alone: the engine comes up and serves.
    outs = engine.generate("after the start", max_tokens=3, ignore_eos=True, use_tqdm=False)
    assert len(outs[0].token_ids) == 3
    # NOTE: the interrupted call's request, submitted once the start went on, is aborted:
    # nothing of it may still run when the next case waits for its own request to run.
    assert_drained(engine)


def case_interrupted_twice(engine: Engine) -> None:
    """A second interrupt lands while the first one's wait for the helper is under way:
    the wait goes on until the helper closed the bar, and the first interrupt is raised."""
    seen = [threading.Event(), threading.Event()]

    def handler(signum: int, frame: object) -> None:
        n = sum(e.is_set() for e in seen)
        seen[n].set()
        raise KeyboardInterrupt(f"interrupt {n + 1}")

    def body(terminal: Terminal) -> None:
        terminal.hold()

        def script() -> None:
            poll(lambda: running(engine), "the request to run")
            sigint()
            wait_event(terminal.closing, "the helper to close the bar")
            sigint()
            wait_event(seen[1], "the second interrupt")
            terminal.release.set()

        error = interrupted(engine, CALLS["generate"], Interrupter(script))
        assert str(error) == "interrupt 1"
        assert terminal.release.is_set(), "raised before the helper closed the bar"
        assert_bar_closed(terminal)

    saved = signal.signal(signal.SIGINT, handler)
    try:
        with_terminal(body)
    finally:
        signal.signal(signal.SIGINT, saved)
    assert_drained(engine)


def case_helper_stuck(engine: Engine) -> None:
    """The wait for a helper that does not finish is bounded; the helper, cancelled, still
    aborts and closes its bar once it runs again."""
    import inlinelm.runtime.sync as sync

    def body(terminal: Terminal) -> None:
        terminal.hold()

        sent: list[float] = []

        def script() -> None:
            poll(lambda: running(engine), "the request to run")
            sent.append(time.monotonic())
            sigint()

        interrupted(engine, CALLS["generate"], Interrupter(script))
        assert sync.CANCEL_WAIT_S <= time.monotonic() - sent[0] < WAIT_S
        wait_event(terminal.closing, "the helper to close the bar")
        terminal.release.set()
        assert_drained(engine)
        poll(lambda: terminal.getvalue().endswith("\n"), "the bar to close")

    bound = sync.CANCEL_WAIT_S
    sync.CANCEL_WAIT_S = 0.5
    try:
        with_terminal(body)
    finally:
        sync.CANCEL_WAIT_S = bound


def child(path: str) -> None:
    """Every case on one echo engine, along ``path``: ``script`` (no running loop) or
    ``loop`` (called from a running loop's task, as in a Jupyter cell)."""
    engine = Engine(runner="echo", echo_step_s=ECHO_STEP_S)

    def cases() -> None:
        case_interrupted_while_starting(engine)
        for name, call in CALLS.items():
            for send_name, send in SENDERS.items():
                print(f"{name} interrupted by {send_name}", flush=True)
                case_interrupted_while_running(engine, call, send)
        if path == "loop":
            case_interrupted_twice(engine)
            case_helper_stuck(engine)
        short: dict[str, Any] = {"max_tokens": 3, "ignore_eos": True, "use_tqdm": False}
        outs = engine.generate("served after the interrupts", **short)
        chats = engine.generate_chat(CONVERSATION, **short)
        assert len(outs[0].token_ids) == len(chats[0].token_ids) == 3
        assert_drained(engine)

    async def cell() -> None:
        cases()

    try:
        if path == "script":
            cases()
        else:
            # NOTE: run_until_complete installs no SIGINT handler (asyncio.run would), so
            # the interrupt lands in run_sync's wait, as in a kernel.
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(cell())
            finally:
                loop.close()
    finally:
        engine.close()
    print("ok")
