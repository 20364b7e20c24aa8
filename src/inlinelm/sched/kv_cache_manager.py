"""Maps requests to KV blocks: prefix-cache lookups, slot allocation, caching, freeing.

The policy on top of :class:`~inlinelm.sched.block_pool.BlockPool`. The scheduler is its
only caller, on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inlinelm.config import EngineConfig
from inlinelm.errors import ConfigError
from inlinelm.sched.block_pool import LONG_CONTEXT_ROOT_HASH, ROOT_HASH, BlockPool, hash_block
from inlinelm.sched.request import Request


@dataclass(slots=True)
class ComputedBlocks:
    """The longest cached prefix of a request: its block ids and how many tokens they hold."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(slots=True)
class PrefixCacheStats:
    """Tokens looked up in the prefix cache at admission, and how many were found."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0 before any query)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    """Allocates, caches and frees the blocks of each request."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.stats = PrefixCacheStats()
        # How many leading blocks of each request are already indexed in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to :meth:`allocate_slots` (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by some request."""
        return self.block_pool.num_used_blocks

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The cached blocks of ``request``'s longest cached prefix (nothing is taken yet).

        Never the whole sequence: the last token is always left to compute, so that the
        step that computes it can sample the next one.
        """
        if not self.enable_caching:
            return ComputedBlocks()
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_full_blocks(request, max_blocks)
        found = ComputedBlocks()
        for index in range(max_blocks):
            tokens = self._tokens(request, index)
            block_id = self.block_pool.lookup(request.block_hashes[index], tokens)
            if block_id is None:
                break
            found.block_ids.append(block_id)
        found.num_tokens = len(found.block_ids) * self.block_size
        return found

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed and in-flight ones.

        ``computed`` (at admission only) is the prefix from :meth:`get_computed_blocks`; it
        is taken along with the new blocks and its tokens count as computed. Returns False,
        changing nothing, when the pool is short.
        """
        hit = computed or ComputedBlocks()
        num_tokens = (
            request.num_computed_tokens
            + request.num_inflight_tokens
            + hit.num_tokens
            + num_new_tokens
        )
        num_held = len(request.block_ids) + len(hit.block_ids)
        num_needed = max(-(-num_tokens // self.block_size) - num_held, 0)
        # Idle cached blocks sit in the free queue: taking them uses up free blocks too.
        num_idle_hits = sum(1 for b in hit.block_ids if self.block_pool.ref_count(b) == 0)
        if num_needed + num_idle_hits > self.num_free_blocks:
            return False
        if computed is not None:
            self._take_computed(request, computed)
        request.block_ids.extend(self.block_pool.allocate(num_needed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that became full and computed since the last call."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash_full_blocks(request, num_full)
        for index in range(start, num_full):
            tokens = self._tokens(request, index)
            self.block_pool.cache(request.block_ids[index], request.block_hashes[index], tokens)
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (cached ones stay reusable until evicted)."""
        # NOTE: last block first, so the prefix blocks other requests may share are the
        # last to be evicted.
        self.block_pool.free(reversed(request.block_ids))
        request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)

    def reset_stats(self) -> PrefixCacheStats:
        """Return the hit counts so far and start new ones."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def _take_computed(self, request: Request, computed: ComputedBlocks) -> None:
        assert not request.block_ids and request.num_computed_tokens == 0, "admitted twice"
        if self.enable_caching:
            self.stats.num_queried_tokens += request.num_tokens
            self.stats.num_hit_tokens += computed.num_tokens
        self.block_pool.touch(computed.block_ids)
        request.block_ids.extend(computed.block_ids)
        request.num_computed_tokens += computed.num_tokens
        self._num_cached_blocks[request.request_id] = len(computed.block_ids)

    def _hash_full_blocks(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for index in range(len(hashes), num_blocks):
            root = LONG_CONTEXT_ROOT_HASH if request.long_context else ROOT_HASH
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, self._tokens(request, index)))

    def _tokens(self, request: Request, index: int) -> list[int]:
        start = index * self.block_size
        return request.all_token_ids[start : start + self.block_size]


def served_context_len(config: EngineConfig, num_kv_blocks: int) -> int:
    """The config's ``max_model_len`` (as the loader resolved it) once a cache of
    ``num_kv_blocks`` holds it and a step can take it whole where prefills are not chunked;
    a config without one (a scheduler built outside the loader: tests, benchmarks) serves
    as many tokens as the cache holds. A ``ConfigError`` names the option that does not fit."""
    capacity = num_kv_blocks * config.block_size
    max_model_len = config.max_model_len or capacity
    if max_model_len > capacity:
        raise ConfigError(
            f"max_model_len {max_model_len} needs more KV blocks than the {num_kv_blocks} "
            f"available ({capacity} tokens): lower max_model_len or give the KV cache more",
            option="max_model_len",
        )
    if not config.enable_chunked_prefill and max_model_len > config.max_num_batched_tokens:
        raise ConfigError(
            "without chunked prefill, max_num_batched_tokens must be >= max_model_len",
            option="max_num_batched_tokens",
        )
    return max_model_len
