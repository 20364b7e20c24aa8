"""Grammars that would crash, stall or starve the compiler: each is refused with a
RequestError from a child process, and this process, its other grammars and its cache
carry on (issue 19: grammar bombs, slow masks, abandoned compiles, the cache's bytes)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from inlinelm.errors import EngineClosedError, RequestError
from inlinelm.structured import StructuredOutput
from inlinelm.structured.cache import spec_key
from inlinelm.structured.compiler import GrammarCompiler
from inlinelm.structured.sandbox_main import MAX_OPTIONAL_PROPERTIES
from tests.structured.conftest import make_compiler
from tests.structured.grammars import (
    REGEX_BOMB,
    SLOW,
    gbnf_chain,
    lark_chain,
    optional_object,
    ref_chain,
)

WAIT_S = 20.0
PLAIN = StructuredOutput.regex("[a-z]{1,8}")


@pytest.fixture
def fresh(tokenizer: Any) -> Iterator[Callable[..., GrammarCompiler]]:
    """Compilers made by the test, closed at its end."""
    made: list[GrammarCompiler] = []

    def make(**options: Any) -> GrammarCompiler:
        made.append(make_compiler(tokenizer, **options))
        return made[-1]

    yield make
    for compiler in made:
        compiler.close()


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Until ``predicate()`` holds, at most ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        pause.wait(0.01)


def is_running(compiler: GrammarCompiler, spec: StructuredOutput) -> bool:
    """Whether ``spec``'s job has reached its child (sent, its reply awaited)."""
    entry = compiler._entries.get(spec_key(spec))
    return entry is not None and entry.running_in is not None and entry.running_in.in_job


def process_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def walk(compiled: Any, tokenizer: Any, text: str) -> bool:
    """Whether ``text`` then EOS is accepted token by token."""
    matcher = compiled.new_matcher()
    for token in [*tokenizer.encode(text), tokenizer.eos_token_id]:
        if not matcher.accept(token):
            return False
    return matcher.is_stopped


@pytest.mark.parametrize(
    "spec",
    [lark_chain(3000), gbnf_chain(5000), ref_chain(1000)],
    ids=["lark-3000", "gbnf-5000", "ref-1000"],
)
def test_a_grammar_that_crashes_the_compiler_is_refused_and_this_process_lives(
    compiler: GrammarCompiler, spec: StructuredOutput
) -> None:
    with pytest.raises(RequestError, match="crashed the grammar compiler") as info:
        compiler.compile(spec)
    assert info.value.param == "structured"
    misses = compiler.stats.misses
    with pytest.raises(RequestError, match="crashed"):
        compiler.compile(spec)  # the refusal is cached: no second crash
    assert compiler.stats.misses == misses
    assert compiler.compile(PLAIN).new_matcher().error is None


def test_a_chain_within_the_child_stack_compiles_and_runs_here(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    assert walk(compiler.compile(lark_chain(1000)), tokenizer, "x")


def test_a_first_mask_over_its_budget_is_refused_and_its_child_ended(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    compiler = fresh(num_slots=1)
    compiler.compile(PLAIN)
    (pid,) = compiler.child_pids
    with pytest.raises(RequestError, match="first token mask") as info:
        compiler.compile(REGEX_BOMB)
    assert info.value.param == "structured"
    with pytest.raises(RequestError, match="first token mask"):
        compiler.compile(REGEX_BOMB)  # cached
    compiler.compile(StructuredOutput.regex("b+"))
    assert pid not in compiler.child_pids and not process_exists(pid)


def test_a_compile_past_the_timeout_is_killed_and_not_cached(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    compiler = fresh(num_slots=1, timeout_s=1.0)
    compiler.compile(PLAIN)
    (pid,) = compiler.child_pids
    with pytest.raises(RequestError, match="longer than 1 s to compile"):
        compiler.compile(SLOW)
    assert not process_exists(pid)
    assert compiler.compile(StructuredOutput.regex("c+")).new_matcher().error is None
    assert spec_key(SLOW) not in compiler._entries


def test_a_running_compile_nobody_waits_for_is_killed(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    compiler = fresh(num_slots=1, timeout_s=600.0)
    waiter = compiler.submit(SLOW)
    wait_for(lambda: is_running(compiler, SLOW), "the slow grammar runs in the child")
    (pid,) = compiler.child_pids
    assert waiter.cancel()
    assert compiler.stats.abandoned == 1
    # NOTE: one slot: the plain grammar compiles only once the slow one's child is killed.
    assert compiler.submit(PLAIN).result(timeout=WAIT_S).new_matcher().error is None
    assert not process_exists(pid)
    assert spec_key(SLOW) not in compiler._entries


def test_abandoned_compiles_do_not_starve_a_plain_one(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    compiler = fresh(num_slots=2, timeout_s=600.0)
    slow = [gbnf_chain(24000 + i) for i in range(4)]
    waiters = [compiler.submit(spec) for spec in slow]
    wait_for(lambda: sum(is_running(compiler, s) for s in slow) == 2, "two slow compiles run")
    for waiter in waiters:
        assert waiter.cancel()
    assert compiler.stats.abandoned == 4
    assert compiler.submit(PLAIN).result(timeout=WAIT_S).new_matcher().error is None
    assert not compiler._queue


def test_a_waiter_of_a_shared_compile_keeps_it_alive(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    compiler = fresh(num_slots=1)
    first, second = compiler.submit(PLAIN), compiler.submit(PLAIN)
    assert first.cancel() or first.done()
    assert second.result(timeout=WAIT_S).new_matcher().error is None
    assert compiler.stats.abandoned == 0


def test_the_cache_is_capped_by_the_grammars_memory(
    fresh: Callable[..., GrammarCompiler], tokenizer: Any
) -> None:
    compiler = fresh(num_slots=1, cache_bytes=4 * 1024**2)
    small = [StructuredOutput.regex(f"{c}+") for c in "abcd"]
    for spec in small:
        compiler.compile(spec)
    assert compiler.stats.num_entries == 4
    kept = compiler.stats.num_bytes
    assert 0 < kept <= 4 * 1024**2
    big = StructuredOutput.json_schema({"enum": [f"value number {i} here" for i in range(20000)]})
    compiled = compiler.compile(big)
    assert compiled.num_bytes > 4 * 1024**2  # measured in the child: several MB
    assert walk(compiled, tokenizer, '"value number 19999 here"')
    # NOTE: bigger than the whole budget: handed out, never kept; the small ones stay.
    assert compiler.stats.num_entries == 4 and compiler.stats.num_bytes == kept
    misses = compiler.stats.misses
    compiler.compile(big)
    assert compiler.stats.misses == misses + 1


def test_the_cache_evicts_the_least_recently_used_past_its_bytes(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    probe = fresh(num_slots=1)
    sizes = sorted(probe.compile(StructuredOutput.regex(f"{c}+")).num_bytes for c in "abc")
    # NOTE: heap measurements vary by a few percent: room for two of them, not three.
    budget = int(2.5 * sizes[1])
    compiler = fresh(num_slots=1, cache_bytes=budget)
    for c in "abc":
        compiler.compile(StructuredOutput.regex(f"{c}+"))
    assert compiler.stats.num_entries == 2
    assert compiler.stats.num_bytes <= budget
    assert spec_key(StructuredOutput.regex("a+")) not in compiler._entries


def test_thousands_of_choices_compile_and_each_can_be_chosen(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    compiled = compiler.compile(StructuredOutput.choice([f"c{i}" for i in range(2500)]))
    for choice in ("c0", "c1999", "c2000", "c2499"):
        assert walk(compiled, tokenizer, choice), choice
    assert not walk(compiled, tokenizer, "c2500")


def test_optional_properties_up_to_the_cap_are_followed_and_past_it_refused(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    last = MAX_OPTIONAL_PROPERTIES - 1
    compiled = compiler.compile(optional_object(MAX_OPTIONAL_PROPERTIES))
    assert walk(compiled, tokenizer, json.dumps({"p5": 1, f"p{last}": 2}))
    with pytest.raises(RequestError, match="optional properties") as info:
        compiler.compile(optional_object(MAX_OPTIONAL_PROPERTIES + 1))
    assert info.value.param == "structured"


def test_close_kills_the_children_and_fails_the_waiters(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    compiler = fresh(num_slots=1, timeout_s=600.0)
    compiler.compile(PLAIN)
    waiter = compiler.submit(SLOW)
    wait_for(lambda: is_running(compiler, SLOW), "the slow grammar runs in the child")
    (pid,) = compiler.child_pids
    compiler.close()
    with pytest.raises(EngineClosedError):
        waiter.result(timeout=WAIT_S)
    assert not process_exists(pid)
    assert compiler.child_pids == []
    with pytest.raises(EngineClosedError):
        compiler.submit(PLAIN)


def test_concurrent_callers_share_one_compile(fresh: Callable[..., GrammarCompiler]) -> None:
    compiler = fresh(num_slots=2)
    spec = StructuredOutput.json_schema({"type": "array", "items": {"type": "integer"}})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(compiler.compile, [spec] * 16))
    assert all(r is results[0] for r in results)
    assert compiler.stats.misses == 1 and compiler.stats.hits == 15


def test_a_child_killed_from_outside_is_not_held_against_the_grammar(
    fresh: Callable[..., GrammarCompiler],
) -> None:
    """The OOM killer or an operator ends a child mid-compile: that compile is refused
    (not cached), the next one gets a new child; children sit in their own session, so a
    Ctrl-C meant for this process never reaches them."""
    compiler = fresh(num_slots=1, timeout_s=600.0)
    waiter = compiler.submit(SLOW)
    wait_for(lambda: is_running(compiler, SLOW), "the slow grammar runs in the child")
    (pid,) = compiler.child_pids
    assert os.getsid(pid) != os.getsid(0)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RequestError, match="process ended while compiling"):
        waiter.result(timeout=WAIT_S)
    assert spec_key(SLOW) not in compiler._entries
    assert compiler.compile(PLAIN).new_matcher().error is None
    assert compiler.child_pids != [pid]
