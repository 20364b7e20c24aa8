"""The grammar sandbox's child program: compiles grammars where a crash cannot hurt.

The engine runs this file as ``python sandbox_main.py`` (see :mod:`inlinelm.structured.sandbox`)
and talks to it over stdin and stdout in frames: a 4-byte big-endian length, then that
many bytes of UTF-8 JSON. The first frame from the parent describes the tokenizer; the
child answers ``{"ready": true}``. Each later frame is one job, ``{"kind", "text",
"mask_budget_s"}``, answered by one reply:

- ``{"ok": true, "grammar", "bytes", "compile_s", "mask_s"}``: the llguidance grammar text
  (what the parent compiles again, in-process, knowing it is safe), the heap the compiled
  grammar held (its estimated memory), and the CPU time of the compile and of the probe;
- ``{"ok": false, "error"}``: why the grammar is refused (a client's mistake); with
  ``"exit": true`` the child ends right after it (a probe it had to cut short).

Each job runs on a thread with a small fixed stack (``STACK_BYTES``), smaller than any
thread of the parent's that compiles or masks the same grammar, so a grammar that passes
here cannot overflow a stack there. A grammar that recurses deeper kills only this
process; the parent sees the pipe close and refuses the grammar.

It imports only the standard library and llguidance (no torch, no inlinelm), so it
starts in well under a second.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

STACK_BYTES = 4 * 1024 * 1024
"""The stack of the thread that compiles and probes: 4 MiB (about 1,300 chained Lark
rules). The parent's grammar threads get eight times as much (``sandbox.PARENT_STACK_BYTES``);
llguidance computes masks without recursing on the grammar's depth."""

MAX_FORCED_STEPS = 32
"""How many forced tokens (masks that allow exactly one) the probe follows past the first
mask: an error right after a forced prefix is found before any request meets it."""

WARM_UP = {"kind": "regex", "text": "x", "mask_budget_s": 60.0}
"""The job a child runs before it says it is ready."""

WATCH_INTERVAL_S = 0.02
"""How often the probe's watchdog reads the first mask's CPU time."""

MAX_OPTIONAL_PROPERTIES = 400
"""The most properties a JSON-schema object may leave optional. llguidance keeps about
four parser items per optional property in one row while a key is read, and refuses a
row of more than 2,000 items mid-generation ("Current row has 2007 items"): at 498
optional properties. Refusing at compile time keeps that failure out of running requests."""

# Lark's own syntax (llguidance's dialect): a `start:` rule or a `%llguidance` directive;
# anything else is read as GBNF (`root ::= ...`) and converted.
_GBNF = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")
# JSON output is compact with one space after "," and ":" (json.dumps' look): flexible
# whitespace lets a model pad forever. A schema can override it with "x-guidance".
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


class Refused(Exception):
    """The grammar is refused; the message says why (it goes to the client)."""


def to_llguidance(kind: str, text: str) -> str:
    """The llguidance grammar text of a constraint (not validated yet); ``Refused`` when
    it cannot be converted."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        if kind in ("json_schema", "json_object"):
            check_schema(json.loads(text))
            return str(LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS))
        if kind == "regex":
            return str(LLMatcher.grammar_from_regex(text))
        if kind == "choice":
            return str(LLMatcher.grammar_from_lark(choice_lark(json.loads(text))))
        lark = gbnf_to_lark(text) if _GBNF.search(text) else text
        return str(LLMatcher.grammar_from_lark(lark))
    except Refused:
        raise
    except Exception as e:  # the GBNF converter raises plain exceptions on bad input
        raise Refused(str(e)) from e


def choice_lark(choices: list[str]) -> str:
    """``start: CHOICE`` with ``CHOICE`` one lexeme of JSON-escaped alternatives.

    NOTE: one terminal, not a rule of alternatives: a rule keeps a parser item per choice
    in one row, and llguidance fails a row of over 2,000 items mid-generation; a lexeme's
    alternatives live in the lexer, which takes tens of thousands.
    """
    return "start: CHOICE\nCHOICE: " + " | ".join(
        json.dumps(c, ensure_ascii=False) for c in choices
    )


def check_schema(schema: Any) -> None:
    """Refuse what llguidance accepts but cannot follow: an object with more than
    ``MAX_OPTIONAL_PROPERTIES`` optional properties (walked without recursion)."""
    for node in _nodes(schema):
        properties = node.get("properties")
        if not isinstance(properties, dict):
            continue
        required = node.get("required")
        names = set(required) if isinstance(required, list) else set()
        optional = sum(1 for name in properties if name not in names)
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise Refused(
                f"an object schema has {optional} optional properties; at most "
                f"{MAX_OPTIONAL_PROPERTIES} can be followed (list more of them in 'required', "
                "or split the object)"
            )


def _nodes(value: Any) -> Iterator[dict[str, Any]]:
    """Every object inside ``value`` (depth first, with an explicit stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def compile_job(tokenizer: Any, job: dict[str, Any], out: Replies) -> dict[str, Any]:
    """One job's reply (see the module docstring); ``out`` is where an overrun probe
    replies before it ends the process."""
    from llguidance import LLMatcher

    kind = job["kind"]
    try:
        start = time.thread_time()
        grammar = to_llguidance(kind, job["text"])
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise Refused(messages[0] if messages else "refused by the compiler")
        before = heap_bytes()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise Refused(matcher.get_error())
        compile_s = time.thread_time() - start
        mask_s = probe(matcher, tokenizer.vocab_size, job["mask_budget_s"], kind, out)
        size = max(heap_bytes() - before, len(grammar))
    except Refused as e:
        return refusal(kind, str(e))
    return {"ok": True, "grammar": grammar, "bytes": size, "compile_s": compile_s, "mask_s": mask_s}


def refusal(kind: str, why: str) -> dict[str, Any]:
    """The reply that refuses a grammar of ``kind`` because of ``why``."""
    return {"ok": False, "error": f"invalid {KIND_NAMES.get(kind, kind)}: {why.strip()}"}


def probe(matcher: Any, vocab_size: int, budget_s: float, kind: str, out: Replies) -> float:
    """Compute the first mask within ``budget_s`` of CPU, then follow forced tokens for up
    to ``MAX_FORCED_STEPS`` masks; a matcher error on the way is ``Refused``. Returns the
    first mask's CPU time.

    NOTE: a mask cannot be interrupted: when the first one outruns its budget, a watchdog
    thread sends the refusal and ends this process, so a slow grammar costs its budget of
    CPU, not the seconds its mask would take.
    """
    words = (vocab_size + 31) // 32
    mask = (ctypes.c_uint32 * words)()
    clock = time.pthread_getcpuclockid(threading.get_ident())
    start = time.clock_gettime(clock)
    why = f"its first token mask takes over {budget_s:.2f} s of CPU: it would stall every other request"
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_INTERVAL_S):
            if time.clock_gettime(clock) - start > budget_s:
                out.last({**refusal(kind, why), "exit": True})

    threading.Thread(target=watch, name="watchdog", daemon=True).start()
    try:
        matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), words * 4)
    finally:
        done.set()
    first_s = time.clock_gettime(clock) - start
    if first_s > budget_s:
        raise Refused(why)
    for _ in range(MAX_FORCED_STEPS):
        _check(matcher)
        token = _only_token(mask, vocab_size)
        if token is None or matcher.is_stopped():
            break
        matcher.consume_token(token)
        _check(matcher)
        matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), words * 4)
    _check(matcher)
    return first_s


def _check(matcher: Any) -> None:
    if matcher.is_error():
        raise Refused(matcher.get_error().split("\n", 1)[0])


def _only_token(mask: Any, vocab_size: int) -> int | None:
    """The one token ``mask`` allows, or None when it allows none or several."""
    found = None
    for index, word in enumerate(mask):
        if not word:
            continue
        if found is not None or word & (word - 1):
            return None
        found = index * 32 + word.bit_length() - 1
    return found if found is not None and found < vocab_size else None


def heap_bytes() -> int:
    """Bytes in use on the C heap (glibc's ``mallinfo2``), else the resident set size."""
    try:
        return _mallinfo_bytes()
    except (AttributeError, OSError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo_bytes() -> int:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def read_frame(stream: IO[bytes]) -> Any:
    """The next frame's JSON value, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream: IO[bytes], value: Any) -> None:
    """Write one frame and flush it."""
    body = json.dumps(value).encode("utf-8")
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


class Replies:
    """The stream of reply frames, written by one thread at a time."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, value: Any) -> None:
        """Write one reply."""
        with self._lock:
            write_frame(self._stream, value)

    def last(self, value: Any) -> None:
        """Write one reply and end the process at once (from any thread)."""
        with self._lock:
            write_frame(self._stream, value)
            os._exit(0)


def on_small_stack(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` on a new thread with a ``STACK_BYTES`` stack."""
    box: dict[str, Any] = {}
    threading.stack_size(STACK_BYTES)
    thread = threading.Thread(target=lambda: box.update(reply=fn()), name="compile")
    thread.start()
    thread.join()
    if "reply" not in box:
        raise SystemExit(3)  # fn raised: its traceback went to stderr
    reply: dict[str, Any] = box["reply"]
    return reply


def main() -> None:
    """Serve jobs until stdin closes (the parent closed it, or died)."""
    import llguidance

    # NOTE: the protocol owns the real stdout; anything else that prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    hello = read_frame(stdin)
    if hello is None:
        return
    tokenizer = llguidance.LLTokenizer(
        hello["tokenizer"], n_vocab=hello["n_vocab"], eos_token=hello["eos_token"]
    )
    replies = Replies(out)
    # NOTE: the first compile allocates llguidance's one-time state (about 300 KB); paid
    # here, it does not count as the first grammar's memory.
    on_small_stack(functools.partial(compile_job, tokenizer, WARM_UP, replies))
    replies.send({"ready": True})
    while (job := read_frame(stdin)) is not None:
        replies.send(on_small_stack(functools.partial(compile_job, tokenizer, job, replies)))


if __name__ == "__main__":
    # NOTE: this file's folder is sys.path[0]; keep its modules from shadowing any other.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    main()
