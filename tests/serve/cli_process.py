"""``inlinelm serve --ray`` as a child process, stopped so that nothing outlives a test."""

from __future__ import annotations

import signal
import subprocess

import psutil

WAIT_S = 120.0
"""How long a signalled CLI (and each Ray process it started) may take to end."""


def descendants(pid: int) -> set[psutil.Process]:
    """Every process ``pid`` started, and theirs."""
    return set(psutil.Process(pid).children(recursive=True))


def stop(
    process: subprocess.Popen[str], sig: signal.Signals, started: set[psutil.Process]
) -> tuple[int | None, list[psutil.Process]]:
    """Send ``sig``; the CLI's exit status (None when it did not end within ``WAIT_S``)
    and the processes of ``started`` still alive by then. Whatever is left is killed, so
    that a failing test leaves no Ray instance burning the next tests' cores."""
    started = started | descendants(process.pid) if process.poll() is None else started
    process.send_signal(sig)
    try:
        returncode: int | None = process.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        returncode = None
    _, alive = psutil.wait_procs(started, timeout=WAIT_S if returncode is not None else 0)
    for leftover in alive:
        leftover.kill()
    if returncode is None:
        process.kill()
        process.wait()
    return returncode, alive
