"""Per-step attention metadata for one flat (varlen) batch of query windows."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .block_table import BlockTable


@dataclass
class AttentionMetadata:
    """Where one step writes KV and what each sequence's queries attend to.

    Sequence ``b`` owns the flat token rows ``query_start_loc[b]..query_start_loc[b+1]-1``; its
    queries sit at positions ``seq_lens[b] - query_len_b .. seq_lens[b] - 1``. ``block_tables``
    rows are padded with block 0 (never read: masked by ``seq_lens``).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: KV length after this step's writes
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    backend: str = "auto"  # the engine's attention_backend (`attention.paged_attention`)
    # A token tree's windows (`tree_masks`): per flat row, the rows of its own window it sees, bit j
    # for window row j (its ancestors and itself); None: every window causal. A tree has up to 64
    # rows; a row of a window that is no tree's has every bit set (causal, any length).
    tree_masks_cpu: list[int] | None = None  # as int64 values (bit 63 the sign bit)
    tree_masks: torch.Tensor | None = None  # [T] int64, the same (a device copy for the kernels)
    # A padded static step's (`target.static_step`): the metadata of its real rows and sequences,
    # what backends reading host lengths attend with (the rows past it are padding); None: unpadded
    real: "AttentionMetadata | None" = field(default=None, repr=False, compare=False)
    # A hybrid model's recurrent states for this step's windows (`state_cache.StateBatch`); None: none
    states: Any = field(default=None, repr=False, compare=False)
    # What an attention backend derives from the fields above, computed by the first layer of a
    # forward and reused by the others (index tensors, masks); keyed by the backend.
    scratch: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)


def build_attention_metadata(
    tables: list[BlockTable],
    starts: list[int],
    ends: list[int],
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata for sequence ``b`` writing and querying positions ``starts[b]..ends[b]-1``.

    Built from host lists with one tensor creation per field. The tables must already hold slots
    for ``ends[b]`` tokens (``ensure_slots``); ``num_computed`` is left for the caller to advance.

    >>> from specdec.cache import BlockPool
    >>> table = BlockTable(BlockPool(4), block_size=4); table.ensure_slots(6)
    True
    >>> meta = build_attention_metadata([table], [3], [6], "cpu")
    >>> meta.slot_mapping.tolist(), meta.seq_lens_cpu, meta.query_lens_cpu
    ([3, 4, 5], [6], [3])
    """
    if not len(tables) == len(starts) == len(ends):
        raise ValueError(
            f"tables, starts and ends differ in length: {len(tables)}, {len(starts)}, {len(ends)}"
        )
    block_size = tables[0].block_size if tables else 1
    if any(t.block_size != block_size for t in tables):
        raise ValueError("all block tables in one batch must share a block size")
    slots: list[int] = []
    query_start_loc = [0]
    for table, start, end in zip(tables, starts, ends):
        slots += table.slot_mapping(start, end)  # validates 0 <= start <= end <= capacity
        query_start_loc.append(len(slots))
    seq_lens = list(ends)
    query_lens = [end - start for start, end in zip(starts, ends)]
    max_seq_len = max(seq_lens, default=0)
    max_blocks = -(-max_seq_len // block_size)
    flat_tables: list[int] = []
    for table, end in zip(tables, ends):
        used = table.block_ids[: -(-end // block_size)]
        flat_tables += used + [0] * (max_blocks - len(used))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(flat_tables, dtype=torch.int32, device=device).view(
            len(tables), max_blocks
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max_seq_len,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )


def compact_blocks(meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """`(block_ids [n], meta')`: the distinct cache blocks this step's sequences read, and the
    metadata with its block tables numbering those blocks 0..n-1 in that order. A caller that
    expands each block into another layout (`[n, S, ...]`: MLA's keys and values decompressed
    from its latents) attends over it with `meta'` as over the cache with `meta`.

    >>> from specdec.cache import BlockPool
    >>> pool = BlockPool(8)
    >>> a, b = BlockTable(pool, block_size=2), BlockTable(pool, block_size=2)
    >>> a.ensure_slots(3), b.ensure_slots(3)  # a holds blocks 0 and 1, b 2 and 3
    (True, True)
    >>> ids, m = compact_blocks(build_attention_metadata([b], [0], [3], "cpu"))
    >>> ids.tolist(), m.block_tables.tolist()
    ([2, 3], [[0, 1]])
    """
    ids, inverse = torch.unique(meta.block_tables, return_inverse=True)
    return ids.long(), replace(meta, block_tables=inverse.to(torch.int32), scratch={})


MAX_TREE_ROWS = 64  # window rows a tree mask covers: one int64 of bits a row
ALL_ROWS = -1  # the mask of a row that is no tree's, every bit set: causal (its later rows are never read)


def tree_masks(parents: list[int]) -> list[int]:
    """The window rows each node of a token tree sees: node ``i`` (window row ``i``, after its
    parent ``parents[i] < i``; -1 for a node under the cached prefix alone) sees its ancestors
    and itself. A chain ``[-1, 0, 1]`` gives the causal bits.

    >>> [bin(m) for m in tree_masks([-1, 0, 0, 1])]
    ['0b1', '0b11', '0b101', '0b1011']
    """
    if len(parents) > MAX_TREE_ROWS:
        raise ValueError(f"a tree mask covers at most {MAX_TREE_ROWS} rows, got {len(parents)}")
    masks: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}'s parent must be an earlier row or -1, got {parent}")
        masks.append((masks[parent] if parent >= 0 else 0) | 1 << i)
    return masks


def with_tree(meta: AttentionMetadata, parents: list[list[int] | None]) -> AttentionMetadata:
    """`meta` with sequence ``b``'s window a token tree of ``parents[b]`` (`tree_masks`; None: its
    window stays causal, whatever its length: a prompt chunk beside a tree). Each tree has its
    window's length."""
    if len(parents) != meta.num_seqs:
        raise ValueError(f"one parents list (or None) a sequence: {meta.num_seqs}, got {len(parents)}")
    rows: list[int] = []
    for b, (tree, query_len) in enumerate(zip(parents, meta.query_lens_cpu)):
        if tree is not None and len(tree) != query_len:
            raise ValueError(f"sequence {b}'s tree has {len(tree)} nodes for a window of {query_len} rows")
        rows += tree_masks(tree) if tree is not None else [ALL_ROWS] * query_len
    signed = [m - (1 << 64) if m >= 1 << 63 else m for m in rows]  # as int64: bit 63 is the sign bit
    return replace(meta, tree_masks_cpu=signed, scratch={},
                   tree_masks=torch.tensor(signed, dtype=torch.int64, device=meta.seq_lens.device))
