"""A child process that compiles a grammar before this process does.

llguidance recurses on a grammar's depth: 3,000 chained Lark rules or 1,000 chained
``$ref``s overflow a thread's stack and kill the whole process (SIGSEGV), which in an app
or a notebook is the user's process. A slow grammar cannot be interrupted in a thread
either. So every new grammar is first compiled and probed by :mod:`sandbox_main` in a
child process: a crash ends only the child, a compile past its timeout is killed, and so
is one nobody waits for any more. The parent then compiles the grammar the child accepted,
on a thread with a larger stack than the child's (see ``sandbox_main.STACK_BYTES``).

A :class:`Sandbox` is one child, used by one thread at a time (a compiler slot's), with
one exception: :meth:`Sandbox.kill` may come from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from inlinelm.structured.sandbox_main import STACK_BYTES

logger = logging.getLogger("inlinelm")

PARENT_STACK_BYTES = 8 * STACK_BYTES
"""The stack of the parent's grammar threads: a grammar that compiled within the child's
stack needs at most that much here, the rest is margin."""

START_TIMEOUT_S = 60.0
"""How long a new child may take to load llguidance and the tokenizer (about half a
second on an idle machine)."""

_PROGRAM = Path(__file__).with_name("sandbox_main.py")
_FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE})


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """What a child needs to build the same ``llguidance.LLTokenizer`` as the parent: the
    tokenizer's JSON (``tokenizers.Tokenizer.to_str()``), its vocabulary size and EOS."""

    json: str
    n_vocab: int | None
    eos_token: int | list[int] | None

    @classmethod
    def from_hf(cls, tokenizer: Any) -> TokenizerSource:
        """The source of a transformers fast tokenizer (as ``llguidance.hf.from_tokenizer``
        reads it: padding and truncation off, EOS from the tokenizer); ``ValueError`` for a
        slow one."""
        import copy

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), None, tokenizer.eos_token_id)

    def build(self) -> Any:
        """The ``llguidance.LLTokenizer`` (about a second for a 49k vocabulary)."""
        import llguidance

        return llguidance.LLTokenizer(self.json, n_vocab=self.n_vocab, eos_token=self.eos_token)


class SandboxCrashed(Exception):
    """The child died during a job (a crash, or a kill); ``returncode`` says how.
    ``before_job``: it was already gone when the job was sent (not the job's doing)."""

    def __init__(self, returncode: int | None, *, before_job: bool = False) -> None:
        super().__init__(f"the grammar compiler process ended (exit status {returncode})")
        self.returncode = returncode
        self.before_job = before_job

    @property
    def is_fault(self) -> bool:
        """Whether the child died of a fault of its own (a stack overflow is a SIGSEGV):
        the grammar's doing, not a kill from outside."""
        return self.returncode is not None and -self.returncode in _FAULTS


class SandboxTimeout(Exception):
    """The child did not answer within the job's time; it has been killed."""


class Sandbox:
    """One child process running ``sandbox_main.py`` (started on construction)."""

    def __init__(self, tokenizer: TokenizerSource) -> None:
        self._process = subprocess.Popen(
            [sys.executable, str(_PROGRAM)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # NOTE: its own session: a Ctrl-C meant for this process must not end a compile
            # in hand (which would then read as the grammar's crash); close() ends it, and it
            # exits by itself when this process dies (its stdin closes).
            start_new_session=True,
        )
        self._stdin: IO[bytes] = self._process.stdin  # type: ignore[assignment]  # PIPE
        self._stdout: IO[bytes] = self._process.stdout  # type: ignore[assignment]  # PIPE
        self._killed = threading.Event()
        self.in_job = False  # a job was sent and its reply is awaited
        hello = {
            "tokenizer": tokenizer.json,
            "n_vocab": tokenizer.n_vocab,
            "eos_token": tokenizer.eos_token,
        }
        try:
            self._send(hello)
            self._receive(START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """False once the child has ended or been killed."""
        return not self._killed.is_set() and self._process.poll() is None

    def run(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one job and wait for its reply: :class:`SandboxTimeout` past ``timeout_s``
        (the child is killed), :class:`SandboxCrashed` when the child dies first."""
        self._send(job)
        self.in_job = True
        try:
            reply = self._receive(timeout_s)
        finally:
            self.in_job = False
        if reply.get("exit"):
            self._crashed()  # NOTE: it ends after this reply: reap it, never send it more
        return reply

    def kill(self) -> None:
        """End the child now (idempotent, from any thread); a job in hand raises
        ``SandboxCrashed`` in the thread that waits for it."""
        self._killed.set()
        with contextlib.suppress(OSError):
            self._process.kill()

    def close(self) -> None:
        """Kill the child and reap it."""
        self.kill()
        self._process.wait()
        for pipe in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):
                pipe.close()

    def _send(self, value: Any) -> None:
        body = orjson.dumps(value)
        try:
            self._stdin.write(struct.pack(">I", len(body)) + body)
            self._stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise self._crashed(before_job=True) from None

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        head = self._read_exactly(4, deadline)
        (size,) = struct.unpack(">I", head)
        reply: dict[str, Any] = orjson.loads(self._read_exactly(size, deadline))
        return reply

    def _read_exactly(self, size: int, deadline: float) -> bytes:
        fd = self._stdout.fileno()
        chunks: list[bytes] = []
        while size > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                self._process.wait()
                raise SandboxTimeout
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, min(size, 1 << 20))
            if not chunk:
                raise self._crashed()
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def _crashed(self, *, before_job: bool = False) -> SandboxCrashed:
        self._killed.set()
        try:
            returncode = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            returncode = self._process.wait()
        return SandboxCrashed(returncode, before_job=before_job)
