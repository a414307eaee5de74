"""A token tree's accepted path kept in the cache (issue 62): `BlockTable.keep_tree_path` rolls the
table back to the root and the path and says which slots move, `PagedKVCache.copy_slots` moves them
in every layer, so the path's KV sits at the positions of a chain; blocks past it go back to the
pool, and nothing else is touched."""

import pytest
import torch

from specdec.cache import BlockPool, BlockTable, KVCacheSpec, PagedKVCache


@pytest.mark.parametrize("path", [[], [1, 2, 3], [2, 5, 9], [1, 4], [7]])
@pytest.mark.parametrize("block_size", [1, 4])
def test_the_path_takes_the_positions_of_a_chain_and_the_rest_goes_back(path, block_size):
    pool = BlockPool(40)
    other = BlockTable(pool, block_size)
    other.ensure_slots(9)  # another sequence's blocks: untouched
    table = BlockTable(pool, block_size)
    prefix, rows = 6, 12  # a tree of 12 rows (the root and 11 drafts) after 6 cached tokens
    table.ensure_slots(prefix + rows)
    table.num_computed = prefix + rows
    cache = PagedKVCache(KVCacheSpec(2, 2, 16, block_size, torch.float32), pool.num_blocks)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    before = cache.kv.clone()
    flat = lambda kv: kv.view(2, 2, -1, 2, 16)  # noqa: E731  [L, 2, slots, H, D]
    window = table.slot_mapping(prefix, prefix + rows)
    kept_rows = [0, *path]
    expected = flat(before)[:, :, [window[r] for r in kept_rows]]
    untouched = table.slot_mapping(0, prefix) + other.slot_mapping(0, 9)

    src, dst = table.keep_tree_path(prefix, path)
    cache.copy_slots(src, dst)

    assert table.num_computed == prefix + 1 + len(path)
    assert len(table.block_ids) == -(-(prefix + 1 + len(path)) // block_size)
    assert pool.num_free == pool.num_blocks - len(table.block_ids) - len(other.block_ids)
    assert torch.equal(flat(cache.kv)[:, :, table.slot_mapping(prefix, prefix + 1 + len(path))], expected)
    assert torch.equal(flat(cache.kv)[:, :, untouched], flat(before)[:, :, untouched])


def test_bad_paths_and_slots_are_refused():
    pool = BlockPool(8)
    table = BlockTable(pool, 4)
    table.ensure_slots(8)
    for bad in ([0, 2], [3, 2], [2, 2]):
        with pytest.raises(ValueError, match="increase"):
            table.keep_tree_path(2, bad)
    cache = PagedKVCache(KVCacheSpec(1, 1, 16, 4, torch.float32), 8)
    with pytest.raises(ValueError, match="differ"):
        cache.copy_slots([1], [])
    with pytest.raises(ValueError, match="slots must be"):
        cache.copy_slots([32], [0])
