"""Token-tree windows in paged attention (issue 62): each node of a tree attends to the cached prefix
and to its ancestors and itself only (`AttentionMetadata.tree_masks`), in the torch reference,
the C kernel and the Triton kernel, and equals the attention of its path laid out as a chain.

Cases come from `test_paged_attention.build_case` (windows over interleaved blocks with garbage in
the unused slots); two of the windows are trees, the others stay causal in the same step.
"""

import random

import pytest
import torch

from specdec.cache import (
    BlockPool, BlockTable, KVCacheSpec, PagedKVCache, build_attention_metadata, cpu_attention, paged_attention_ref,
    paged_attention_triton, write_kv,
)
from specdec.cache.metadata import tree_masks, with_tree
from tests.cache.test_cpu_attention import BF16_TOL, _run
from tests.cache.test_paged_attention import HEAD_DIM, TOL, _on_device, build_case, needs_triton

# (seq_len, query_len): two tree windows (9 and 7 nodes), a decode row and a causal verify window
WINDOWS = [(40, 9), (30, 7), (20, 1), (50, 12)]
SCALE = HEAD_DIM**-0.5


def _random_parents(n: int, rng: random.Random) -> list[int]:
    """A tree of n nodes under node 0 (the step's last accepted token): each node's parent an earlier one."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _ancestors(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def _case(block_size: int, group: int, dtype: torch.dtype, seed: int = 0):
    query, cache, meta, per_seq = build_case(block_size, group, dtype, windows=WINDOWS, seed=seed)
    rng = random.Random(seed)
    parents = [_random_parents(9, rng), _random_parents(7, rng), None, None]
    return query, cache, with_tree(meta, parents), meta, per_seq, parents


def _per_path(per_seq, parents) -> torch.Tensor:  # [T, Hq, D] float64
    """Each node's attention over the prefix and its path, as a chain of those keys would give it."""
    out = []
    for (q, k, v), tree in zip(per_seq, parents):
        n, seq_len = q.shape[0], k.shape[0]
        prefix = seq_len - n
        tree = tree if tree is not None else list(range(-1, n - 1))
        for i in range(n):
            keep = list(range(prefix)) + [prefix + j for j in _ancestors(tree, i)]
            group = q.shape[1] // k.shape[1]
            keys = k[keep].double().repeat_interleave(group, 1)  # [L, Hq, D]
            values = v[keep].double().repeat_interleave(group, 1)
            probs = (torch.einsum("hd,lhd->hl", q[i].double(), keys) * SCALE).softmax(-1)  # [Hq, L]
            out.append(torch.einsum("hl,lhd->hd", probs, values))
    return torch.stack(out)


def test_tree_masks_are_ancestors_and_self():
    assert tree_masks([-1, 0, 1, 2]) == [0b1, 0b11, 0b111, 0b1111]  # a chain: causal
    assert tree_masks([-1, 0, 0, 2, 1]) == [0b1, 0b11, 0b101, 0b1101, 0b10011]
    with pytest.raises(ValueError, match="parent"):
        tree_masks([-1, 2, 0])
    with pytest.raises(ValueError, match="at most 64"):
        tree_masks(list(range(-1, 64)))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_gives_each_node_its_paths_attention(block_size, group, dtype):
    query, cache, meta, causal, per_seq, parents = _case(block_size, group, dtype)
    out = paged_attention_ref(query, *cache.layer(0), meta, SCALE)
    torch.testing.assert_close(out.double(), _per_path(per_seq, parents), **TOL[dtype])
    # negative control: the same rows causal are not their paths' attention
    plain = paged_attention_ref(query, *cache.layer(0), causal, SCALE)
    assert (plain.double() - _per_path(per_seq, parents)).abs().max() > 0.1


@pytest.mark.skipif(cpu_attention.load_attention() is None, reason="CPU attention kernel unavailable")
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 7])
def test_the_c_kernel_gives_each_node_its_paths_attention(block_size, group, simd_level):
    query, cache, meta, causal, per_seq, parents = _case(block_size, group, torch.bfloat16, seed=1)
    out, _ = _run(query, cache, meta, per_seq)
    torch.testing.assert_close(out.double(), _per_path(per_seq, parents), **BF16_TOL)
    torch.testing.assert_close(out.float(), paged_attention_ref(query, *cache.layer(0), meta, SCALE).float(),
                               **BF16_TOL)
    plain, _ = _run(query, cache, causal, per_seq)
    assert (plain.double() - _per_path(per_seq, parents)).abs().max() > 0.1


def _chain_row(q_row, keys, values, block_size):
    """The C kernel's row for one query after keys[:-1] cached and the last key its own: the
    node's path fed as a chain, decoded one row at a time."""
    num = keys.shape[0]
    pool = BlockPool(num // block_size + 2)
    table = BlockTable(pool, block_size)
    table.ensure_slots(num)
    cache = PagedKVCache(KVCacheSpec(1, keys.shape[1], HEAD_DIM, block_size, torch.bfloat16), pool.num_blocks)
    before = build_attention_metadata([table], [0], [num - 1], "cpu")
    write_kv(keys[:-1], values[:-1], *cache.layer(0), before.slot_mapping, cache.k_scale, cache.v_scale)
    out, _ = _run(q_row, cache, build_attention_metadata([table], [num - 1], [num], "cpu"), [(q_row, keys, values)])
    return out[0]


@pytest.mark.skipif(cpu_attention.load_attention() is None, reason="CPU attention kernel unavailable")
@pytest.mark.parametrize("block_size", [1, 16])
def test_the_c_kernel_gives_each_node_bitwise_its_chains_row(block_size, simd_level):
    """A node's row is bitwise its path's row fed as a chain (so greedy trees keep target-only's
    tokens at near ties): the kernel reads the prefix and the node's ancestors as one run of keys.
    The windows straddle 16-key chunks (prefixes 31, 23)."""
    query, cache, meta, _, per_seq, parents = _case(block_size, 2, torch.bfloat16, seed=3)
    out, _ = _run(query, cache, meta, per_seq)
    t = 0
    for (q, k, v), tree in zip(per_seq, parents):
        n, prefix = q.shape[0], k.shape[0] - q.shape[0]
        for i in range(n):
            keep = list(range(prefix)) + [prefix + j for j in _ancestors(tree or list(range(-1, n - 1)), i)]
            assert torch.equal(out[t], _chain_row(q[i : i + 1], k[keep], v[keep], block_size)), (t, i)
            t += 1


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_gives_each_node_its_paths_attention(dtype):
    query, cache, meta, _, per_seq, parents = _case(4, 2, dtype, seed=2)
    query, (k_cache, v_cache), meta = _on_device(query, cache, meta)
    if meta.tree_masks.device != query.device:
        from dataclasses import replace

        meta = replace(meta, tree_masks=meta.tree_masks.to(query.device))
    out = paged_attention_triton(query, k_cache, v_cache, meta, SCALE).cpu()
    torch.testing.assert_close(out.double(), _per_path(per_seq, parents), **TOL[dtype])


def test_a_tree_must_fit_its_window():
    _, _, meta, _, _, _ = _case(4, 1, torch.float32)
    with pytest.raises(ValueError, match="nodes for a window"):
        with_tree(meta, [[-1, 0], None, None, None])
    with pytest.raises(ValueError, match="one parents list"):
        with_tree(meta, [None])
