"""Whole KV blocks as bytes, out of one paged cache and into another (prefill/decode handoff).

Blocks travel in the cache's own order, `[L, 2, n, S, Hkv, D]` of its dtype (a latent cache's
`[L, 1, n, S, 1, D]`) (so reading and
writing them is one gather and one scatter along the block axis), carried as `uint8` so fp8 and
bf16 travel as they are stored. Two caches can exchange blocks only when their specs are equal
(`check_compatible`); nothing is converted.

    data = read_blocks(cache, [4, 9])                 # [L, 2, 2, S, Hkv, D] as bytes
    write_blocks(pool, cache2, [key_a, key_b], data)  # cached in cache2's pool under the keys
    write_held_block(pool, cache2, read_blocks(cache, [5]))  # a block with no key, held by the caller
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .block_pool import BlockKey, BlockPool
from .kv_cache import KVCacheSpec, PagedKVCache


def transit_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
    """`num_blocks` blocks in transit: `[L, 2, n, S, Hkv, D * element size]` bytes (latent: 1 plane)."""
    element = torch.empty((), dtype=spec.dtype).element_size()
    return (spec.num_layers, spec.planes, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim * element)


def read_blocks(cache: PagedKVCache, block_ids: list[int]) -> np.ndarray:
    """`[L, 2, n, S, Hkv, D]` of the cache's dtype as bytes (`uint8`, last axis times the element
    size): a copy, so the blocks may be freed once it returns."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.kv.device)
    blocks = cache.kv.index_select(2, index)  # [L, 2, n, S, H, D], contiguous
    return blocks.view(torch.uint8).cpu().numpy().reshape(transit_shape(cache.spec, len(block_ids)))


def write_blocks(pool: BlockPool, cache: PagedKVCache, keys: list[BlockKey], data: np.ndarray) -> int:
    """Put blocks read by `read_blocks` into `cache` as cached, unheld blocks of `pool` under
    `keys` (a prefix lookup finds them; they are evicted like any freed block). Keys the pool
    already caches are skipped; when free blocks run short the rest are dropped (a later prefill
    recomputes them). Returns how many blocks were written."""
    _check_shape(cache, data, len(keys))
    missing = [i for i, key in enumerate(keys) if pool.lookup(key) is None]
    missing = missing[: pool.num_free]
    if not missing or not pool.enable_caching:
        return 0
    block_ids = pool.allocate(len(missing))  # all at once: none of them evicts another
    try:
        _scatter(cache, block_ids, data if len(missing) == len(keys) else data[:, :, missing])
        for block_id, i in zip(block_ids, missing):
            pool.register(block_id, keys[i])
    finally:
        pool.free(reversed(block_ids))  # cached and unheld (the tail evicted first), or free again
    return len(missing)


def write_held_block(pool: BlockPool, cache: PagedKVCache, data: np.ndarray) -> int | None:
    """Put one block read by `read_blocks` (a prompt's partial last block: no key) into a newly
    allocated block of `pool` and return its id, held once by the caller; None when the pool has
    no free block."""
    _check_shape(cache, data, 1)
    if pool.num_free == 0:
        return None
    (block_id,) = pool.allocate(1)
    try:
        _scatter(cache, [block_id], data)
    except BaseException:
        pool.free([block_id])
        raise
    return block_id


def _check_shape(cache: PagedKVCache, data: np.ndarray, num_blocks: int) -> None:
    expected = transit_shape(cache.spec, num_blocks)
    if tuple(data.shape) != expected or data.dtype != np.uint8:
        raise ValueError(f"blocks of shape {tuple(data.shape)} ({data.dtype}) do not fit this cache: "
                         f"expected {expected} (uint8)")


def _scatter(cache: PagedKVCache, block_ids: list[int], data: np.ndarray) -> None:
    with warnings.catch_warnings():  # read-only bytes (Ray's object store): only ever read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(np.ascontiguousarray(data)).to(cache.kv.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.kv.device)
    cache.kv.index_copy_(2, index, blocks.view(cache.spec.dtype))  # [L, 2, n, S, H, D]


def check_compatible(sender: KVCacheSpec, receiver: KVCacheSpec) -> None:
    """ValueError naming the first field in which two caches' blocks differ."""
    for name in ("num_layers", "num_kv_heads", "head_dim", "latent_rank", "block_size", "dtype"):
        a, b = getattr(sender, name), getattr(receiver, name)
        if a != b:
            raise ValueError(f"KV caches differ in {name}: {a} vs {b}")
