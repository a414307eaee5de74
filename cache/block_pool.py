"""A fixed pool of KV-cache blocks: a free list, reference counts and a prefix cache of full blocks."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the pool has free."""


BlockKey = bytes  # a 16-byte BLAKE2b digest; see block_key


def block_key(parent: BlockKey | None, token_ids: Iterable[int], salt: str | None = None) -> BlockKey:
    """The key of a full block: a digest of its tokens chained to the key of the block before it.

    Equal keys mean equal token prefixes up to the block's end, hence equal KV. A 128-bit
    cryptographic digest (as vLLM's sha256 option) so that no crafted prompt can collide with
    another user's prefix and read its KV. ``salt`` (first block only) isolates requests that must
    not share anything.

    >>> a = block_key(None, [1, 2]); a == block_key(None, [1, 2]), a == block_key(None, [2, 1])
    (True, False)
    >>> block_key(a, [3, 4]) == block_key(None, [3, 4])
    False
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    if salt is not None:
        h.update(salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prefix_block_keys(token_ids: list[int], block_size: int, salt: str | None = None) -> list[BlockKey]:
    """The keys of every full block of ``token_ids``, chained as a ``BlockTable`` chains them: what
    a pool holding this prefix has cached under (a router matches these against a replica's keys).

    >>> keys = prefix_block_keys([1, 2, 3, 4, 5], block_size=2)
    >>> len(keys), keys[1] == block_key(block_key(None, [1, 2]), [3, 4])
    (2, True)
    """
    keys: list[BlockKey] = []
    for i in range(len(token_ids) // block_size):
        keys.append(block_key(keys[-1] if keys else None, token_ids[i * block_size : (i + 1) * block_size],
                              salt if i == 0 else None))
    return keys


@dataclass
class PrefixCacheStats:
    """Tokens asked for and found in a pool's prefix cache (prompts only)."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockPool:
    """Hands out block ids ``0..num_blocks-1``; a block is free again when its count reaches 0.

    ``allocate`` and ``free`` are O(1) per block. Shared blocks are shared with ``incref`` (or
    ``acquire`` for a cached block) and released by one ``free`` per holder.

    Prefix caching (``enable_caching``): a holder ``register``s a block once its tokens are all
    written and final, under its ``BlockKey``. When the last holder frees it, the block keeps its
    KV and its key, and waits in least-recently-freed order; ``lookup`` + ``acquire`` hand it to a
    later request with the same prefix. ``allocate`` takes never-used blocks first and evicts the
    least recently freed cached block only when there are none. So ``num_free`` (what ``allocate``
    can hand out) counts the cached blocks nobody holds (``num_cached``) as well.

    >>> pool = BlockPool(4)
    >>> ids = pool.allocate(3)
    >>> pool.num_free, pool.num_used
    (1, 3)
    >>> pool.free(ids)
    >>> pool.num_free
    4
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._empty_ids: deque[int] = deque(range(num_blocks))  # free, holding nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self.stats = PrefixCacheStats()
        # a hybrid model's `state_cache.RecurrentStateCache`, whose slots the tables of this pool
        # take (`BlockTable.state_slot`); None: the model has no linear-attention layers
        self.states = None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: never-used ones plus unheld cached ones."""
        return len(self._empty_ids) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Unheld blocks kept for their cached prefix (evicted when a free block is needed)."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._num_blocks - self.num_free

    def cached_keys(self) -> tuple[BlockKey, ...]:
        """The keys of every cached block, held or not (what a prefix lookup would find)."""
        return tuple(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many holders share ``block_id`` (0 when it is free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {self.num_free} of {self._num_blocks} are free"
            )
        block_ids = []
        for _ in range(n):
            if self._empty_ids:
                block_id = self._empty_ids.popleft()
            else:  # evict the least recently freed cached block
                block_id, _ = self._evictable.popitem(last=False)
                del self._cached[self._keys[block_id]]
                self._keys[block_id] = None
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each (already allocated) block."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot incref block {block_id}: it is free")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block holding ``key``'s tokens, held or not; None on a miss."""
        return self._cached.get(key) if self.enable_caching else None

    def acquire(self, block_id: int) -> None:
        """Become a holder of a cached block found by ``lookup`` (it leaves the eviction queue)."""
        self._check_id(block_id)
        if self._keys[block_id] is None:
            raise ValueError(f"block {block_id} is not cached")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, key: BlockKey) -> bool:
        """Cache a held, full block under ``key``; False (not cached) when caching is off or the
        key is already cached in another block (then this block stays private)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot register block {block_id}: it is free")
        if not self.enable_caching or key in self._cached:
            return self._cached.get(key) == block_id
        if self._keys[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached under another key")
        self._keys[block_id] = key
        self._cached[key] = block_id
        return True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block at zero becomes free (cached blocks keep their
        KV until evicted; pass a sequence's blocks last-first so its tail is evicted first).

        Validated before anything changes: freeing a free block (or freeing a block more times
        than it has holders) raises ``ValueError`` and leaves the pool untouched.
        """
        block_ids = list(block_ids)
        counts = Counter(block_ids)
        for block_id, times in counts.items():
            self._check_id(block_id)
            if times > self._ref_counts[block_id]:
                raise ValueError(
                    f"cannot free block {block_id} {times} time(s): it has "
                    f"{self._ref_counts[block_id]} holder(s)"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._keys[block_id] is None:
                    self._empty_ids.append(block_id)
                else:
                    self._evictable[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget every unheld cached block (held ones stay cached); returns how many."""
        dropped = list(self._evictable)
        for block_id in dropped:
            del self._cached[self._keys[block_id]]
            self._keys[block_id] = None
            self._empty_ids.append(block_id)
        self._evictable.clear()
        return len(dropped)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool (0..{self._num_blocks - 1})")
