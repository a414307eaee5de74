"""build_attention_metadata: flat varlen batch layout from block tables and windows."""

import pytest
import torch

from specdec.cache import BlockPool, BlockTable, build_attention_metadata


def _tables(pool, block_size, lengths):
    tables = []
    for n in lengths:
        table = BlockTable(pool, block_size)
        assert table.ensure_slots(n)
        tables.append(table)
    return tables


def test_varlen_batch_layout():
    pool = BlockPool(16)
    prefill, decode, verify = _tables(pool, 4, [6, 9, 12])
    meta = build_attention_metadata([prefill, decode, verify], [0, 8, 7], [6, 9, 12], "cpu")
    assert meta.query_lens_cpu == [6, 1, 5] and meta.seq_lens_cpu == [6, 9, 12]
    assert meta.query_start_loc.tolist() == [0, 6, 7, 12]
    assert meta.seq_lens.tolist() == [6, 9, 12]
    assert (meta.max_query_len, meta.max_seq_len) == (6, 12)
    expected = prefill.slot_mapping(0, 6) + decode.slot_mapping(8, 9) + verify.slot_mapping(7, 12)
    assert meta.slot_mapping.tolist() == expected
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (3, 3)
    assert meta.block_tables.tolist() == [
        prefill.block_ids + [0],
        decode.block_ids + [0] * (3 - len(decode.block_ids)),
        verify.block_ids,
    ]
    assert (meta.num_seqs, meta.num_tokens) == (3, 12)


def test_block_tables_only_cover_attended_positions():
    pool = BlockPool(8)
    (table,) = _tables(pool, 2, [10])  # lookahead slots beyond this step's end
    meta = build_attention_metadata([table], [2], [3], "cpu")
    assert meta.block_tables.tolist() == [table.block_ids[:2]]


def test_empty_batch():
    meta = build_attention_metadata([], [], [], "cpu")
    assert meta.slot_mapping.numel() == 0 and meta.block_tables.shape == (0, 0)
    assert meta.query_start_loc.tolist() == [0] and meta.max_query_len == 0


def test_bad_windows_raise_value_error():
    pool = BlockPool(4)
    (table,) = _tables(pool, 4, [4])
    with pytest.raises(ValueError, match="differ in length"):
        build_attention_metadata([table], [0, 1], [4], "cpu")
    with pytest.raises(ValueError, match="ensure_slots"):
        build_attention_metadata([table], [0], [5], "cpu")
    with pytest.raises(ValueError, match="start <= end"):
        build_attention_metadata([table], [3], [2], "cpu")
    other = BlockTable(pool, 2)
    other.ensure_slots(2)
    with pytest.raises(ValueError, match="block size"):
        build_attention_metadata([table, other], [0, 0], [4, 2], "cpu")
