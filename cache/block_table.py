"""One sequence's view of a paged KV cache: its block ids and how many tokens are written."""

from __future__ import annotations

from .block_pool import BlockKey, BlockPool, NoFreeBlocksError, block_key


class BlockTable:
    """The blocks one sequence holds in one model's cache, in position order.

    Token position ``p`` lives in block ``block_ids[p // S]`` at offset ``p % S``; its flat slot in
    the ``[N * S]`` cache is ``block_ids[p // S] * S + p % S``. ``num_computed`` counts the tokens
    whose KV has been written; the model runner advances it after a forward, rollback lowers it
    with ``truncate``.

    Prefix caching: ``match_prefix`` starts a table on the pool's cached blocks for the longest
    known prefix; ``cache_full_blocks`` offers the pool every block whose tokens are all written
    and final. Both make those blocks *frozen*: the first ``num_frozen_tokens`` positions are never
    written again (other tables may share them), so rollback never goes below them.
    """

    def __init__(self, pool: BlockPool, block_size: int, salt: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.salt = salt
        self.block_ids: list[int] = []
        self.block_keys: list[BlockKey] = []  # keys of the frozen blocks block_ids[:len(block_keys)]
        self.num_computed = 0
        # a hybrid model's recurrent-state slot (`state_cache`), taken on the first forward from
        # `pool.states` and given back by `free`; None: none taken (or no linear-attention layers)
        self.state_slot: int | None = None

    def __repr__(self) -> str:
        return (
            f"BlockTable(block_size={self.block_size}, num_computed={self.num_computed}, "
            f"block_ids={self.block_ids})"
        )

    @property
    def num_frozen_tokens(self) -> int:
        """Positions held in frozen (cached, possibly shared) blocks: never written again."""
        return len(self.block_keys) * self.block_size

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
        if num_tokens < self.num_frozen_tokens:
            raise ValueError(
                f"cannot roll back to {num_tokens} tokens: the first {self.num_frozen_tokens} are in "
                "frozen (cached) blocks"
            )
        self.num_computed = min(self.num_computed, num_tokens)
        num_keep = -(-num_tokens // self.block_size)
        if num_keep < len(self.block_ids):
            self.pool.free(self.block_ids[num_keep:])
            del self.block_ids[num_keep:]

    def keep_tree_path(self, window_start: int, path: list[int]) -> tuple[list[int], list[int]]:
        """After a token tree's window (positions ``window_start..``, row ``r`` at position
        ``window_start + r``) kept its root and the accepted rows ``path`` (increasing, each under
        the one before it): roll back to the root and the path, ``window_start + 1 + len(path)``
        tokens. Returns ``(src, dst)``, the slots whose KV the caller moves (`PagedKVCache.copy_slots`)
        so path row ``path[i]``'s KV sits at position ``window_start + 1 + i``; rows already in
        place are left out.

        >>> table = BlockTable(BlockPool(4), block_size=4)
        >>> table.ensure_slots(8); table.num_computed = 8     # prefix 0..2, a tree of 5 rows at 3..7
        True
        >>> table.keep_tree_path(3, [2, 4])                   # rows 2 and 4 -> positions 4 and 5
        ([5, 7], [4, 5])
        >>> table.num_computed, len(table.block_ids)
        (6, 2)
        """
        if any(not a < b for a, b in zip([0, *path], path)):
            raise ValueError(f"a tree path's rows increase from row 1, got {path}")
        end = window_start + 1 + (path[-1] if path else 0)
        slots = self.slot_mapping(window_start, end)
        moves = [(slots[r], slots[i + 1]) for i, r in enumerate(path) if r != i + 1]
        self.truncate(window_start + 1 + len(path))
        return [a for a, _ in moves], [b for _, b in moves]

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

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> int:
        """Start an empty table on the pool's cached blocks for the longest cached prefix of
        ``token_ids``, whole blocks only and at most ``max_tokens`` tokens (a caller that needs
        logits keeps at least its last token out). Returns the tokens reused (``num_computed``).

        >>> pool = BlockPool(4); a = BlockTable(pool, block_size=2); a.ensure_slots(5)
        True
        >>> a.num_computed = 5; a.cache_full_blocks([7, 8, 9, 10, 11])   # 2 full blocks cached
        >>> b = BlockTable(pool, block_size=2)
        >>> b.match_prefix([7, 8, 9, 10, 12], max_tokens=4), b.block_ids == a.block_ids[:2]
        (4, True)
        """
        if self.block_ids:
            raise ValueError("match_prefix starts an empty table")
        parent: BlockKey | None = None
        for i in range(min(max_tokens, len(token_ids)) // self.block_size):
            key = self._key(parent, token_ids, i)
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            self.pool.acquire(block_id)
            self.block_ids.append(block_id)
            self.block_keys.append(key)
            parent = key
        self.num_computed = self.num_frozen_tokens
        return self.num_computed

    def attach_partial(self, block_id: int, num_tokens: int) -> bool:
        """Append a block whose first ``num_tokens`` (< block size) slots already hold KV written
        elsewhere (a prompt's partial last block handed over by another engine), after the table's
        full blocks; the caller's reference becomes the table's. False (nothing changed) unless
        every block so far is full.

        >>> pool = BlockPool(4); t = BlockTable(pool, block_size=4); (b,) = pool.allocate(1)
        >>> t.attach_partial(b, 3), t.num_computed, t.block_ids == [b]
        (True, 3, True)
        """
        if not 0 < num_tokens < self.block_size or self.num_computed != len(self.block_ids) * self.block_size:
            return False
        self.block_ids.append(block_id)
        self.num_computed += num_tokens
        return True

    def cache_full_blocks(self, token_ids: list[int]) -> None:
        """Offer the pool every block whose positions are all written (``< num_computed``) with
        the final ``token_ids``; they become frozen. The caller guarantees that the KV below
        ``num_computed`` belongs to ``token_ids`` (after rollback, never to rejected drafts)."""
        if not self.pool.enable_caching:
            return
        num_full = min(self.num_computed, len(token_ids)) // self.block_size
        for i in range(len(self.block_keys), num_full):
            key = self._key(self.block_keys[-1] if self.block_keys else None, token_ids, i)
            self.pool.register(self.block_ids[i], key)
            self.block_keys.append(key)

    def _key(self, parent: BlockKey | None, token_ids: list[int], i: int) -> BlockKey:
        size = self.block_size
        return block_key(parent, token_ids[i * size : (i + 1) * size], self.salt if i == 0 else None)

    def free(self) -> None:
        """Return every block to the pool (last first, so a cached tail is evicted before its
        prefix) and forget all written tokens."""
        self.pool.free(reversed(self.block_ids))
        self.block_ids = []
        self.block_keys = []
        self.num_computed = 0
        if self.state_slot is not None:
            self.pool.states.release(self.state_slot)
            self.state_slot = None
