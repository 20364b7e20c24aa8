"""The grammar cache: one entry per ``(kind, text)``, compiling or done, and its stats.

A :class:`CacheEntry` is a grammar being compiled (its ``waiters`` wait for it) or done
(its ``outcome`` set: a :class:`~inlinelm.structured.grammar.CompiledGrammar` or the
refusal). :class:`GrammarCache` keeps at most ``max_entries`` done entries and
``max_bytes`` of their estimated memory, dropping the least recently used first; an entry
in flight is never evicted and not counted until it is done. Refusals are kept like
grammars, except a :class:`NotCached` one (a timeout, a cancelled or failed compile), which
says nothing about the grammar.

The cache is plain data: it starts no compile and takes no lock. Every method runs under
the lock of the :class:`~inlinelm.structured.compiler.GrammarCompiler` that owns it, and
:func:`resolve` hands an outcome to a waiter outside it.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from dataclasses import dataclass, field

from inlinelm.errors import RequestError
from inlinelm.structured.grammar import PARAM, CompiledGrammar
from inlinelm.structured.sandbox import Sandbox
from inlinelm.structured.spec import StructuredOutput

Key = tuple[str, str]
Waiter = concurrent.futures.Future[CompiledGrammar]


@dataclass(slots=True)
class CacheStats:
    """Requests served from the cache or from a compile in flight (hits), compiles
    started (misses), compiles dropped because nobody waited (abandoned), and the cache's
    size now."""

    hits: int = 0
    misses: int = 0
    abandoned: int = 0
    num_entries: int = 0
    num_bytes: int = 0


@dataclass(eq=False, slots=True)
class CacheEntry:
    """One grammar: compiling (``waiters`` wait for it) or done (``outcome`` set)."""

    key: Key
    spec: StructuredOutput
    waiters: set[Waiter] = field(default_factory=set)
    outcome: CompiledGrammar | BaseException | None = None
    num_bytes: int = 0
    running_in: Sandbox | None = None
    abandoned: bool = False


class NotCached(RequestError):
    """A refusal that says nothing about the grammar itself (a timeout, a cancelled or
    failed compile): handed to the waiters, never cached."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param=PARAM)


class GrammarCache:
    """The entries by key, least recently used first (see the module docstring)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._entries: OrderedDict[Key, CacheEntry] = OrderedDict()
        self.stats = CacheStats()

    def get(self, key: Key) -> CacheEntry | None:
        """The entry of ``key``, compiling or done; not counted, not made recent."""
        return self._entries.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def lookup(self, key: Key) -> CacheEntry | None:
        """The entry of ``key``, counted as a hit and made the most recently used, or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self.stats.hits += 1
            self._entries.move_to_end(key)
        return entry

    def add(self, spec: StructuredOutput) -> CacheEntry:
        """A new entry for ``spec``, in flight, counted as a miss."""
        self.stats.misses += 1
        entry = CacheEntry(spec_key(spec), spec)
        self._entries[entry.key] = entry
        return entry

    def in_flight(self) -> list[CacheEntry]:
        """The entries still compiling."""
        return [entry for entry in self._entries.values() if entry.outcome is None]

    def abandon(self, entry: CacheEntry) -> None:
        """Mark ``entry`` abandoned (nobody waits for it) and forget it, so that a later
        request compiles it again."""
        entry.abandoned = True
        self.stats.abandoned += 1
        self._discard(entry)

    def finish(self, entry: CacheEntry, outcome: CompiledGrammar | BaseException) -> set[Waiter]:
        """Set ``entry``'s outcome and keep it (unless it was abandoned, is
        :class:`NotCached`, or is bigger than the whole byte budget), then evict what is
        over the budgets; returns the waiters to hand ``outcome`` to."""
        entry.running_in = None
        entry.outcome = outcome
        waiters, entry.waiters = entry.waiters, set()
        entry.num_bytes = _size_of(outcome)
        # NOTE: a grammar bigger than the whole budget would evict every other one.
        keep = (
            not entry.abandoned
            and not isinstance(outcome, NotCached)
            and entry.num_bytes <= self._max_bytes
        )
        if keep and self._entries.get(entry.key) is entry:
            self.stats.num_entries += 1
            self.stats.num_bytes += entry.num_bytes
            self._evict()
        else:
            self._discard(entry)
        return waiters

    def _discard(self, entry: CacheEntry) -> None:
        """Forget ``entry`` if it is still its key's (a later one may have taken the key)."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]

    def _evict(self) -> None:
        """Drop the least recently used done entries past the count or byte budget."""
        stats = self.stats
        for key in list(self._entries):
            if stats.num_entries <= self._max_entries and stats.num_bytes <= self._max_bytes:
                return
            entry = self._entries[key]
            if entry.outcome is None:
                continue  # NOTE: in flight: its waiters hold it, and it is not counted yet
            del self._entries[key]
            stats.num_entries -= 1
            stats.num_bytes -= entry.num_bytes


def spec_key(spec: StructuredOutput) -> Key:
    """The cache key of ``spec``."""
    return (spec.kind, spec.text)


def resolve(waiter: Waiter, outcome: CompiledGrammar | BaseException) -> None:
    """Set ``waiter``'s outcome unless its caller already cancelled it."""
    try:
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # NOTE: cancelled meanwhile: nobody reads it


def _size_of(outcome: CompiledGrammar | BaseException) -> int:
    if isinstance(outcome, CompiledGrammar):
        return outcome.num_bytes
    return len(str(outcome))
