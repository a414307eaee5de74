"""Paged KV cache: block pool, block tables, KV tensors, attention metadata and paged attention;
the recurrent states of linear-attention layers (`state_cache`)."""

from .attention import paged_attention, paged_attention_ref, write_kv, write_latent
from .block_pool import BlockKey, BlockPool, NoFreeBlocksError, PrefixCacheStats, block_key
from . import cpu_attention
from .block_table import BlockTable
from .kv_cache import KVCacheSpec, PagedKVCache
from .metadata import AttentionMetadata, build_attention_metadata, compact_blocks
from .state_cache import RecurrentStateCache, StateBatch, StatePool, StateSpec
from .triton_attention import paged_attention_triton, triton_available

__all__ = [
    "AttentionMetadata",
    "BlockKey",
    "BlockPool",
    "PrefixCacheStats",
    "block_key",
    "BlockTable",
    "KVCacheSpec",
    "NoFreeBlocksError",
    "PagedKVCache",
    "RecurrentStateCache",
    "StateBatch",
    "StatePool",
    "StateSpec",
    "build_attention_metadata",
    "compact_blocks",
    "cpu_attention",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
    "triton_available",
    "write_kv",
    "write_latent",
]
