"""BlockTable: slot mapping, growth without partial allocation, rollback."""

import pytest

from specdec.cache import BlockPool, BlockTable


def test_slot_mapping_follows_block_ids():
    pool = BlockPool(8)
    pool.allocate(3)  # make the table's blocks non-trivial
    table = BlockTable(pool, block_size=4)
    assert table.ensure_slots(10)
    table.block_ids = [5, 3, 7]  # order matters, not the ids' order
    assert table.slot_mapping(0, 10) == [20, 21, 22, 23, 12, 13, 14, 15, 28, 29]
    assert table.slot_mapping(6, 9) == [14, 15, 28]
    assert table.slot_mapping(4, 4) == []


def test_slot_mapping_rejects_positions_without_slots():
    table = BlockTable(BlockPool(4), block_size=4)
    table.ensure_slots(5)
    with pytest.raises(ValueError, match="ensure_slots"):
        table.slot_mapping(0, 9)
    with pytest.raises(ValueError, match="start <= end"):
        table.slot_mapping(3, 2)


def test_blocks_needed_and_capacity():
    table = BlockTable(BlockPool(8), block_size=4)
    assert table.blocks_needed(0) == 0
    assert table.blocks_needed(1) == 1
    assert table.blocks_needed(9) == 3
    table.ensure_slots(5)
    assert table.capacity == 8
    assert table.blocks_needed(8) == 0 and table.blocks_needed(9) == 1


def test_ensure_slots_false_allocates_nothing():
    pool = BlockPool(3)
    table = BlockTable(pool, block_size=2)
    assert table.ensure_slots(3)
    ids = list(table.block_ids)
    assert not table.ensure_slots(9)  # needs 3 more, 1 free
    assert table.block_ids == ids and pool.num_free == 1
    assert table.ensure_slots(6)
    assert pool.num_free == 0


def test_ensure_slots_never_shrinks():
    table = BlockTable(BlockPool(4), block_size=2)
    table.ensure_slots(7)
    assert table.ensure_slots(2) and len(table.block_ids) == 4


def test_truncate_rolls_back_and_returns_whole_blocks():
    pool = BlockPool(4)
    table = BlockTable(pool, block_size=4)
    table.ensure_slots(16)
    table.num_computed = 14
    table.truncate(9)  # keeps tokens 0..8: blocks 0..2
    assert table.num_computed == 9 and len(table.block_ids) == 3 and pool.num_free == 1
    table.truncate(8)  # block boundary: block 2 is now wholly past the end
    assert len(table.block_ids) == 2 and pool.num_free == 2
    table.truncate(12)  # never raises num_computed or grows
    assert table.num_computed == 8 and len(table.block_ids) == 2
    table.truncate(0)
    assert table.block_ids == [] and pool.num_free == 4


def test_truncate_keeps_lookahead_slots_within_the_last_block():
    table = BlockTable(BlockPool(4), block_size=4)
    table.ensure_slots(8)
    table.num_computed = 3
    table.truncate(5)
    assert table.num_computed == 3 and len(table.block_ids) == 2


def test_free_returns_everything():
    pool = BlockPool(4)
    table = BlockTable(pool, block_size=2)
    table.ensure_slots(7)
    table.num_computed = 7
    table.free()
    assert (table.block_ids, table.num_computed, pool.num_free) == ([], 0, 4)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError):
        BlockTable(BlockPool(1), block_size=0)
    table = BlockTable(BlockPool(1), block_size=2)
    with pytest.raises(ValueError):
        table.truncate(-1)
    with pytest.raises(ValueError):
        table.blocks_needed(-1)
