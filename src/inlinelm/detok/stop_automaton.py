"""The Aho–Corasick automaton behind :class:`~inlinelm.detok.stop_strings.StopStrings`.

A node is a distinct prefix of the stop strings; node 0 is the root (""). The trie is kept as
*chains*: inserting a stop appends one node per character past the longest prefix of it
already in the trie, numbered consecutively, so a node's child along the stop that made it is
the next node, and only branch points (at most one per stop, plus the root) need a dict. The
nodes' characters are one string and their flags bytes, so building costs C-level string
work plus O(stops²) Python steps however long the stops are, and memory is a few bytes per
character.

A node's failure link, and the two answers read off it (the longest stop that ends at the
node, the hold-back), are computed when a matcher first enters the node: with the failure
targets it needs that are not known yet, each computed once per request. So a text costs at
most a few steps per character it feeds, and nodes no text reaches cost nothing. The links
are a cache: every answer is the same whichever choice computed them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Chain:
    """The nodes one stop added: node ``base + k`` is ``stop[: lcp + 1 + k]``.

    The stop's first ``lcp`` characters were in the trie already, ending at node ``attach``,
    whose child for ``stop[lcp]`` is ``base``.
    """

    stop: str
    base: int
    lcp: int
    attach: int

    @property
    def num_nodes(self) -> int:
        return len(self.stop) - self.lcp


class StopAutomaton:
    """The trie of ``stops`` with lazily computed failure links.

    ``next_chars[n]`` is the character of node ``n + 1`` when ``more[n]`` (``n``'s child along
    its chain); ``fail``, ``match`` (index + 1 of the longest stop ending at the node, 0 for
    none) and ``hold`` (the longest proper stop prefix that ends the node's text) are valid
    for a node once ``fail[node] >= 0``, which :meth:`reach` makes true. NOTE: a computed
    node's failure target is computed, so a walk down failure links only meets computed nodes.
    """

    __slots__ = (
        "_bases",
        "_branches",
        "_chains",
        "_terminals",
        "fail",
        "first_chars",
        "hold",
        "match",
        "more",
        "next_chars",
        "root_children",
        "stops",
    )

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._branches: dict[int, dict[str, int]] = {}
        self._chains: list[Chain] = []
        self._bases: list[int] = []  # each chain's base, ascending
        self._terminals: dict[int, int] = {}
        num_nodes = self._insert_all()
        self._lay_out(num_nodes)
        self.root_children = self._branches.get(0, {})
        # NOTE: from the root only a stop's first character leads anywhere, so a matcher at
        # the root passes over text without one (a C-level set check) without a Python loop
        self.first_chars = frozenset(self.root_children)

    def goto(self, node: int, char: str) -> int:
        """The node after ``char`` from ``node`` (``node`` and its failure chain are computed)."""
        next_chars, more, branches, fail = self.next_chars, self.more, self._branches, self.fail
        while True:
            if next_chars[node] == char and more[node]:
                return node + 1
            children = branches.get(node)
            if children is not None:
                child = children.get(char)
                if child is not None:
                    return child
            if node == 0:
                return 0
            node = fail[node]

    def reach(self, node: int) -> None:
        """Compute ``node``'s links, and any failure targets they need that are not known yet.

        ``node``'s parent must be computed: true of any node :meth:`goto` returns from a
        computed one. Each target is shallower than the node that needs it, and is the child
        of a computed node, so the loop ends and every node is computed once.
        """
        pending = [node]
        while pending:
            node = pending[-1]
            chain = self._chains[bisect_right(self._bases, node) - 1]
            depth = chain.lcp + 1 + node - chain.base
            parent = node - 1 if node > chain.base else chain.attach
            target = self.goto(self.fail[parent], chain.stop[depth - 1]) if depth > 1 else 0
            if self.fail[target] < 0:
                pending.append(target)
                continue
            self._link(node, target, depth)
            pending.pop()

    def _link(self, node: int, fail: int, depth: int) -> None:
        self.fail[node] = fail
        stop = self._terminals.get(node)
        self.match[node] = self.match[fail] if stop is None else stop + 1
        has_children = self.more[node] or node in self._branches
        self.hold[node] = depth if has_children else self.hold[fail]

    def _insert_all(self) -> int:
        """Add every stop's chain and terminal; return the number of nodes."""
        num_nodes = 1
        chain_at: dict[int, Chain] = {}
        for index, stop in enumerate(self.stops):
            attach, lcp = self._walk(stop, chain_at)
            if lcp == len(stop):  # a prefix of an earlier stop: its node exists
                self._terminals[attach] = index
                continue
            chain = Chain(stop, num_nodes, lcp, attach)
            self._branches.setdefault(attach, {})[stop[lcp]] = num_nodes
            self._chains.append(chain)
            self._bases.append(num_nodes)
            chain_at[num_nodes] = chain
            num_nodes += chain.num_nodes
            self._terminals[num_nodes - 1] = index
        return num_nodes

    def _walk(self, stop: str, chain_at: dict[int, Chain]) -> tuple[int, int]:
        """The node of the longest prefix of ``stop`` in the trie, and that prefix's length.

        Runs along a chain are measured with string comparisons, so the Python steps are one
        per chain the path enters, not one per character.
        """
        node, depth, chain = 0, 0, None
        while True:
            if chain is not None:  # along the chain, at most to its last node
                run = common_run(stop, chain.stop, depth)
                node, depth = node + run, depth + run
            if depth == len(stop):
                return node, depth
            child = self._branches.get(node, {}).get(stop[depth])
            if child is None:
                return node, depth
            node, depth, chain = child, depth + 1, chain_at[child]

    def _lay_out(self, num_nodes: int) -> None:
        """The flat per-node tables; only the root's links are known yet."""
        chars = ["\0"]
        more = bytearray(num_nodes)
        for chain in self._chains:
            # NOTE: the chain's last node has no chain child; its "\0" is masked by ``more``.
            chars.append(chain.stop[chain.lcp + 1 :] + "\0")
            more[chain.base : chain.base + chain.num_nodes - 1] = b"\x01" * (chain.num_nodes - 1)
        self.next_chars = "".join(chars)
        self.more = bytes(more)
        self.fail = array("i", [-1]) * num_nodes
        self.fail[0] = 0
        self.match = array("i", [0]) * num_nodes
        self.hold = array("i", [0]) * num_nodes


def common_run(a: str, b: str, start: int) -> int:
    """How many characters ``a`` and ``b`` share from ``start`` on (binary search, C compares)."""
    low, high = start, min(len(a), len(b))
    while low < high:  # NOTE: a[start:low] == b[start:low] throughout
        mid = (low + high + 1) // 2
        if a.startswith(b[low:mid], low):
            low = mid
        else:
            high = mid - 1
    return low - start
