"""The KV block pool: block ids, ref counts, a free queue and the prefix-cache index.

It only allocates; which request holds which block is the manager's business
(:mod:`inlinelm.sched.kv_cache_manager`).

A full block may carry a chain hash (hash of its parent's hash and its own token ids).
A cached block whose ref count drops to 0 stays in the index *and* in the free queue; it is
evicted (its hash forgotten) only when the free queue hands it out again. The free queue is
ordered least-recently-freed first, so eviction is LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# The parent hash of a sequence's first block, and of a long-context sequence's first block
# (``Request.long_context``: the same tokens, other KV).
ROOT_HASH = 0
LONG_CONTEXT_ROOT_HASH = 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chain hash of a full block (deterministic within one process)."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True)
class Block:
    """One fixed-size KV block: its holders and, once full and computed, its cache key."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # Kept to rule out hash collisions on lookup.
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockPool:
    """``num_blocks`` blocks handed out by id, shared by ref count, reused by prefix hash."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        assert num_blocks >= 1, "the KV cache needs at least one block"
        self.enable_caching = enable_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        """Total number of blocks."""
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks indexed by prefix hash (held or evictable)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id``."""
        return self._blocks[block_id].ref_count

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref count 1), evicting their cache entries.

        The caller checks ``num_free_blocks`` first; asking for more is a bug.
        """
        assert num_blocks <= len(self._free), "allocate() beyond num_free_blocks"
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; unreferenced blocks join the free queue's tail.

        Pass a request's blocks last-first, so its tail blocks (the least shareable) are
        evicted before its prefix.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (cached) block, taking it off the free queue if idle."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The id of the cached block with this hash and these tokens, if any."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def cache(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Index a full, computed block under its chain hash.

        If another block already holds the same content (two requests computed the same
        prefix at once), the first one stays indexed and this one stays private.
        """
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self._blocks[block_id]
        assert block.block_hash is None, f"block {block_id} is already cached"
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (held blocks stay allocated)."""
        for block in self._blocks:
            self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
