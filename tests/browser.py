"""Headless Chromium driven over the DevTools protocol, with nothing but the standard library.

Chromium started with ``--remote-debugging-pipe`` reads protocol commands from its fd 3 and
writes replies and events to its fd 4, each message one JSON text ended by a NUL byte: no
websocket, no driver binary, no browser download (Debian's ``chromium`` package is enough)::

    with Browser.launch() as browser:
        page = browser.new_page()
        page.goto("http://127.0.0.1:8000/")
        page.type("#prompt", "hi")
        page.wait_for("document.title !== ''")
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",  # NOTE: the sandbox refuses to run as root, which CI is.
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--mute-audio",
    "--window-size=1000,760",
    "--remote-debugging-pipe",
)
# argv: the two pipe ends, then the browser's command line.
_PLACE_FDS = """
import os, sys
command_in, reply_out = int(sys.argv[1]), int(sys.argv[2])
os.dup2(command_in, 3)
os.dup2(reply_out, 4)
os.close(command_in)
os.close(reply_out)
os.execv(sys.argv[3], sys.argv[3:])
"""


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or went away."""


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable on ``PATH``, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class Browser:
    """One headless Chromium process and its protocol pipe."""

    def __init__(
        self, process: subprocess.Popen[bytes], to_browser: int, from_browser: int
    ) -> None:
        self.process = process
        self._to_browser = to_browser
        self._replies: dict[int, queue.SimpleQueue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._reader = threading.Thread(
            target=self._read, args=(from_browser,), name="cdp-reader", daemon=True
        )
        self._reader.start()

    @classmethod
    @contextmanager
    def launch(cls, executable: str | None = None) -> Iterator[Browser]:
        """Start a headless browser with a fresh profile; close it on exit."""
        path = executable or find_chromium()
        if path is None:
            raise BrowserError("no chromium on PATH")
        command_in, command_out = os.pipe()  # we write commands, the browser reads fd 3
        reply_in, reply_out = os.pipe()  # the browser writes fd 4, we read replies
        command_in, reply_out = _above_four(command_in), _above_four(reply_out)
        with tempfile.TemporaryDirectory(prefix="inlinelm-chromium-") as profile:
            # NOTE: a small Python places the pipe ends on fds 3 and 4, then becomes the
            # browser (a preexec_fn is unsafe in a process with threads, and the test server
            # runs one; dash takes single-digit fds only).
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _PLACE_FDS,
                    str(command_in),
                    str(reply_out),
                    path,
                    *FLAGS,
                    f"--user-data-dir={profile}",
                    "about:blank",
                ],
                pass_fds=(command_in, reply_out),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            os.close(command_in)
            os.close(reply_out)
            browser = cls(process, command_out, reply_in)
            try:
                yield browser
            finally:
                browser.close()

    def new_page(self) -> Page:
        """A new tab, attached (commands for it go through this pipe with its session id)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self, session["sessionId"])
        page.send("Page.enable")
        page.send("Runtime.enable")
        return page

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        """Send one command and wait for its reply (its ``result``)."""
        with self._lock:
            self._next_id += 1
            message_id = self._next_id
            replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
            self._replies[message_id] = replies
            message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
            if session is not None:
                message["sessionId"] = session
            os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        try:
            reply = replies.get(timeout=60)
        except queue.Empty:
            raise BrowserError(f"{method}: no reply in 60 s") from None
        finally:
            self._replies.pop(message_id, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def close(self) -> None:
        """Ask the browser to quit, then make sure it has."""
        with suppress(BrowserError, OSError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)

    def _read(self, fd: int) -> None:
        buffer = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                for raw in messages:
                    message = json.loads(raw)
                    replies = self._replies.get(message.get("id", -1))
                    if replies is not None:
                        replies.put(message)
        for replies in list(self._replies.values()):
            replies.put({"error": "the browser closed its pipe"})


def _above_four(fd: int) -> int:
    """``fd`` moved to a number above 4, so that placing the pipes on 3 and 4 clobbers neither."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return moved


class Page:
    """One tab: navigate, evaluate JavaScript, type and click as a person does, screenshot."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def goto(self, url: str) -> None:
        """Load ``url`` and wait until its document has loaded."""
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when a promise)."""
        result = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy; its value (fails after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"not true within {timeout} s: {expression}")
            time.sleep(0.02)
        return value

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element ``selector`` selects."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1},
            )

    def type(self, selector: str, text: str) -> None:
        """Focus ``selector`` with a click and type ``text`` into it."""
        self.click(selector)
        self.send("Input.insertText", {"text": text})

    def press_enter(self) -> None:
        """Press Enter in whatever has the focus."""
        for kind in ("keyDown", "keyUp"):
            self.send(
                "Input.dispatchKeyEvent",
                {
                    "type": kind,
                    "key": "Enter",
                    "code": "Enter",
                    "windowsVirtualKeyCode": 13,
                    **({"text": "\r"} if kind == "keyDown" else {}),
                },
            )

    def screenshot(self) -> bytes:
        """A PNG of the viewport."""
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
