"""A fixed pool of KV-cache blocks: a free list plus reference counts."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the pool has free."""


class BlockPool:
    """Hands out block ids ``0..num_blocks-1``; a block is free again when its count reaches 0.

    ``allocate`` and ``free`` are O(1) per block (a deque of free ids). Shared blocks (for
    example a common prompt prefix) are shared with ``incref`` and released by one ``free`` per
    holder.

    >>> pool = BlockPool(4)
    >>> ids = pool.allocate(3)
    >>> pool.num_free, pool.num_used
    (1, 3)
    >>> pool.free(ids)
    >>> pool.num_free
    4
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free_ids)

    def ref_count(self, block_id: int) -> int:
        """How many holders share ``block_id`` (0 when it is free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_ids):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free_ids)} of "
                f"{self._num_blocks} are free"
            )
        block_ids = [self._free_ids.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
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

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block at zero goes back on the free list.

        Validated before anything changes: freeing a free block (or freeing a block more times
        than it has holders) raises ``ValueError`` and leaves the pool untouched.
        """
        counts = Counter(block_ids)
        for block_id, times in counts.items():
            self._check_id(block_id)
            if times > self._ref_counts[block_id]:
                raise ValueError(
                    f"cannot free block {block_id} {times} time(s): it has "
                    f"{self._ref_counts[block_id]} holder(s)"
                )
        for block_id, times in counts.items():
            self._ref_counts[block_id] -= times
            if self._ref_counts[block_id] == 0:
                self._free_ids.append(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool (0..{self._num_blocks - 1})")
