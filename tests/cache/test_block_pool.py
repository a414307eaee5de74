"""BlockPool: all-or-nothing allocation, reference counts, loud double frees, conservation."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache import BlockPool, BlockTable, NoFreeBlocksError


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    first = pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks but only 1"):
        pool.allocate(2)
    assert (pool.num_free, pool.num_used) == (1, 3)
    assert len(set(first + pool.allocate(1))) == 4


def test_no_free_blocks_error_is_a_runtime_error():
    assert issubclass(NoFreeBlocksError, RuntimeError)


def test_freed_blocks_are_reused():
    pool = BlockPool(2)
    ids = pool.allocate(2)
    pool.free(ids)
    assert sorted(pool.allocate(2)) == sorted(ids)


def test_shared_block_is_free_only_after_every_holder_frees_it():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_free == 2 and pool.ref_count(block) == 1
    pool.free([block])
    assert pool.num_free == 3 and pool.ref_count(block) == 0


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match="cannot free block"):
        pool.free([b, a])
    assert pool.ref_count(b) == 1 and pool.num_free == 2
    with pytest.raises(ValueError, match="cannot free block"):
        pool.free([b, b])
    assert pool.ref_count(b) == 1


def test_bad_ids_and_counts_raise_value_error():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([5])
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="it is free"):
        pool.incref([0])
    with pytest.raises(ValueError):
        BlockPool(-1)


NUM_BLOCKS = 12
OPS = st.lists(
    st.tuples(
        st.sampled_from(["ensure", "truncate", "free", "compute"]),
        st.integers(0, 3),  # table
        st.integers(0, 60),  # tokens
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 3, 4, 16]), ops=OPS)
def test_block_tables_conserve_blocks(block_size, ops):
    pool = BlockPool(NUM_BLOCKS)
    tables = [BlockTable(pool, block_size) for _ in range(4)]
    for op, i, n in ops:
        table = tables[i]
        before = list(table.block_ids)
        if op == "ensure":
            free_before = pool.num_free
            if table.ensure_slots(n):
                assert table.capacity >= n
                assert table.block_ids[: len(before)] == before
            else:
                assert table.block_ids == before and pool.num_free == free_before
                assert table.blocks_needed(n) > free_before
        elif op == "truncate":
            computed = table.num_computed
            table.truncate(n)
            assert table.num_computed == min(computed, n)
            assert table.block_ids == before[: math.ceil(n / block_size)]
        elif op == "free":
            table.free()
            assert table.block_ids == [] and table.num_computed == 0 and table.capacity == 0
        else:  # the runner wrote KV up to some position it has slots for
            table.num_computed = min(n, table.capacity)
        _check_invariants(pool, tables)
    for table in tables:
        table.free()
    assert pool.num_free == NUM_BLOCKS and pool.num_used == 0


def _check_invariants(pool, tables):
    owned = [b for t in tables for b in t.block_ids]
    assert pool.num_free + pool.num_used == NUM_BLOCKS
    assert len(owned) == len(set(owned)), "a block is owned by two tables"
    assert len(owned) == pool.num_used
    assert all(pool.ref_count(b) == 1 for b in owned)
    assert sum(pool.ref_count(b) for b in range(NUM_BLOCKS)) == len(owned)
    assert all(t.num_computed <= t.capacity for t in tables)
