"""One sequence's view of a paged KV cache: its block ids and how many tokens are written."""

from __future__ import annotations

from .block_pool import BlockPool, NoFreeBlocksError


class BlockTable:
    """The blocks one sequence holds in one model's cache, in position order.

    Token position ``p`` lives in block ``block_ids[p // S]`` at offset ``p % S``; its flat slot in
    the ``[N * S]`` cache is ``block_ids[p // S] * S + p % S``. ``num_computed`` counts the tokens
    whose KV has been written; the model runner advances it after a forward, rollback lowers it
    with ``truncate``.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.block_ids: list[int] = []
        self.num_computed = 0

    def __repr__(self) -> str:
        return (
            f"BlockTable(block_size={self.block_size}, num_computed={self.num_computed}, "
            f"block_ids={self.block_ids})"
        )

    @property
    def capacity(self) -> int:
        """Tokens the held blocks can store."""
        return len(self.block_ids) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks needed to hold ``num_tokens`` tokens (0 if the table already can)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return max(0, -(-num_tokens // self.block_size) - len(self.block_ids))

    def ensure_slots(self, num_tokens: int) -> bool:
        """Grow the table so that positions ``0..num_tokens-1`` have slots.

        All or nothing: when the pool is short it returns False and the table is unchanged.
        Never shrinks (use ``truncate``).

        >>> table = BlockTable(BlockPool(3), block_size=4)
        >>> table.ensure_slots(6), table.capacity      # 2 blocks
        (True, 8)
        >>> table.ensure_slots(13), table.capacity     # needs 4 blocks, the pool has 3
        (False, 8)
        """
        needed = self.blocks_needed(num_tokens)
        if needed == 0:
            return True
        try:
            self.block_ids.extend(self.pool.allocate(needed))
        except NoFreeBlocksError:
            return False
        return True

    def truncate(self, num_tokens: int) -> None:
        """Roll back to the first ``num_tokens`` tokens.

        ``num_computed`` becomes ``min(num_computed, num_tokens)``; slots past it hold stale KV that
        the next write overwrites. Blocks lying wholly past ``num_tokens`` go back to the pool.

        >>> table = BlockTable(BlockPool(4), block_size=4)
        >>> table.ensure_slots(12); table.num_computed = 11   # 3 blocks, 11 tokens written
        True
        >>> table.truncate(5)                                # keep tokens 0..4
        >>> table.num_computed, len(table.block_ids)
        (5, 2)
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.num_computed = min(self.num_computed, num_tokens)
        num_keep = -(-num_tokens // self.block_size)
        if num_keep < len(self.block_ids):
            self.pool.free(self.block_ids[num_keep:])
            del self.block_ids[num_keep:]

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``start..end-1`` (``block_ids[p // S] * S + p % S``)."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        if end > self.capacity:
            raise ValueError(
                f"positions up to {end - 1} need {end} slots but the table holds {self.capacity}"
                " (call ensure_slots first)"
            )
        size, ids = self.block_size, self.block_ids
        return [ids[p // size] * size + p % size for p in range(start, end)]

    def free(self) -> None:
        """Return every block to the pool and forget all written tokens."""
        self.pool.free(self.block_ids)
        self.block_ids = []
        self.num_computed = 0
