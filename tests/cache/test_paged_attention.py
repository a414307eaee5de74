"""Paged attention (torch reference and Triton kernel) against dense causal attention.

Each case is one varlen batch mixing a prefill window (query_len == seq_len), a decode window
(1 token) and verify windows (5 and 9 tokens) over a cached prefix. The prefix and the window
are written in two steps, as the engine does, into blocks interleaved across sequences; unused
slots hold large garbage that masking must hide.
"""

import os

import pytest
import torch

from specdec.cache import (
    BlockPool,
    BlockTable,
    KVCacheSpec,
    PagedKVCache,
    build_attention_metadata,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
    triton_available,
    write_kv,
)

FP8 = torch.float8_e4m3fn
HEAD_DIM = 32
NUM_KV_HEADS = 2
# (seq_len, query_len) per sequence
MIXED = [(37, 37), (50, 1), (150, 5), (29, 9)]  # a long prefill window: masked GQA SDPA path
DECODE = [(50, 1), (150, 5), (29, 9), (16, 16)]  # short windows only: folded-heads path
WINDOWS = MIXED


def build_case(block_size, group, dtype, kv_dtype=None, kv_scale=1.0, windows=WINDOWS, seed=0):
    """Returns (query [T, Hq, D], cache, meta, per-sequence (q, k, v) for the dense reference)."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    num_q_heads = NUM_KV_HEADS * group
    max_blocks = max(s for s, _ in windows) // block_size + 1
    pool = BlockPool(len(windows) * max_blocks + 3)
    pool.allocate(3)  # tables start past block 0, the padding entry of block_tables
    tables = [BlockTable(pool, block_size) for _ in windows]
    for n in range(1, max_blocks + 1):  # interleave blocks across sequences
        for table, (seq_len, _) in zip(tables, windows):
            table.ensure_slots(min(n * block_size, seq_len))

    spec = KVCacheSpec(1, NUM_KV_HEADS, HEAD_DIM, block_size, kv_dtype)
    cache = PagedKVCache(spec, pool.num_blocks, kv_scale=kv_scale)
    cache.kv.copy_((torch.randn(cache.kv.shape, generator=g) * 30).to(kv_dtype))  # garbage
    k_cache, v_cache = cache.layer(0)
    keys = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s, _ in windows]
    values = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for s, _ in windows]
    prefixes = [s - q for s, q in windows]
    for starts, ends in [([0] * len(windows), prefixes), (prefixes, [s for s, _ in windows])]:
        meta = build_attention_metadata(tables, starts, ends, "cpu")
        new_k = torch.cat([k[a:b] for k, a, b in zip(keys, starts, ends)])  # [T, Hkv, D]
        new_v = torch.cat([v[a:b] for v, a, b in zip(values, starts, ends)])
        write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping, cache.k_scale, cache.v_scale)
    queries = [torch.randn(q, num_q_heads, HEAD_DIM, generator=g).to(dtype) for _, q in windows]
    return torch.cat(queries), cache, meta, list(zip(queries, keys, values))


def dense_causal_attention(q, k, v, scale):
    """Plain attention of q [Q, Hq, D] over contiguous k, v [L, Hkv, D]; queries are the last Q."""
    num_queries, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    q = q.double()
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Q, L]
    query_pos = torch.arange(seq_len - num_queries, seq_len)
    visible = torch.arange(seq_len)[None, :] <= query_pos[:, None]  # [Q, L]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [Q, Hq, D]


def assert_matches_dense(out, per_seq, scale, dtype=torch.float32):
    torch.testing.assert_close(out.double(), expected_output(per_seq, scale), **TOL[dtype])


def expected_output(per_seq, scale, kv_transform=lambda x: x):
    return torch.cat(
        [dense_causal_attention(q, kv_transform(k), kv_transform(v), scale) for q, k, v in per_seq]
    )


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
GRID = pytest.mark.parametrize(
    "block_size,group,dtype",
    [
        pytest.param(s, g, d, id=f"S{s}-G{g}-{str(d).removeprefix('torch.')}")
        for s in (1, 4, 16)
        for g in (1, 2, 4)
        for d in (torch.float32, torch.bfloat16)
    ],
)


def _fp8_roundtrip(x, scale):
    return (x.float() / scale).to(FP8).float() * scale


@GRID
@pytest.mark.parametrize("windows", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_matches_dense(block_size, group, dtype, windows):
    query, cache, meta, per_seq = build_case(block_size, group, dtype, windows=windows)
    scale = HEAD_DIM**-0.5
    out = paged_attention_ref(query, *cache.layer(0), meta, scale, cache.k_scale, cache.v_scale)
    assert out.dtype == dtype and out.shape == query.shape
    assert_matches_dense(out, per_seq, scale, dtype)


@pytest.mark.parametrize("block_size,group", [(1, 1), (4, 2), (16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_with_fp8_kv(block_size, group, dtype):
    kv_scale = 0.5
    query, cache, meta, per_seq = build_case(block_size, group, dtype, FP8, kv_scale)
    scale = HEAD_DIM**-0.5
    out = paged_attention_ref(query, *cache.layer(0), meta, scale, cache.k_scale, cache.v_scale)
    assert out.dtype == dtype
    # e4m3 keeps 3 mantissa bits: compare loosely with the exact values ...
    torch.testing.assert_close(out.double(), expected_output(per_seq, scale), atol=0.15, rtol=0.1)
    # ... and tightly with the values as fp8 stores them (stored = x / scale, read = stored * scale)
    exact = expected_output(per_seq, scale, lambda x: _fp8_roundtrip(x, kv_scale))
    torch.testing.assert_close(out.double(), exact, **TOL[dtype])


def test_reference_handles_empty_windows_and_uniform_batches():
    scale = HEAD_DIM**-0.5
    for windows in ([(12, 3), (7, 0), (20, 3)], [(9, 4), (30, 4)]):
        query, cache, meta, per_seq = build_case(4, 2, torch.float32, windows=windows)
        out = paged_attention_ref(query, *cache.layer(0), meta, scale)
        assert_matches_dense(out, per_seq, scale)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("windows", [[(45, 45)], [(40, 40), (40, 40)], [(60, 40), (45, 45)]])
def test_reference_long_windows(windows, group):
    query, cache, meta, per_seq = build_case(4, group, torch.float32, windows=windows)
    scale = HEAD_DIM**-0.5
    out = paged_attention_ref(query, *cache.layer(0), meta, scale)
    assert_matches_dense(out, per_seq, scale)


def test_reference_splits_large_batches_into_chunks(monkeypatch):
    import specdec.cache.attention as attention

    monkeypatch.setattr(attention, "_GATHER_BYTES", 1)  # one sequence per SDPA call
    windows = [(12, 3), (7, 0), (40, 40), (20, 1)]
    query, cache, meta, per_seq = build_case(4, 2, torch.float32, windows=windows)
    scale = HEAD_DIM**-0.5
    out = paged_attention_ref(query, *cache.layer(0), meta, scale)
    assert_matches_dense(out, per_seq, scale)


def _prompts_case(first, lengths, num_q_heads, num_kv_heads, head_dim, seed=0):
    """Whole prompts (query = seq_len) in bf16 over 16-token blocks: the first one's (q, k, v)
    `first`, random others of `lengths`. Returns (query, k_cache, v_cache, meta)."""
    lengths = [first[0].shape[0], *lengths]
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(sum(n // 16 + 2 for n in lengths) + 1)
    pool.allocate(1)
    tables = [BlockTable(pool, 16) for _ in lengths]
    for table, n in zip(tables, lengths):
        table.ensure_slots(n)
    cache = PagedKVCache(KVCacheSpec(1, num_kv_heads, head_dim, 16, torch.bfloat16), pool.num_blocks)
    k_cache, v_cache = cache.layer(0)
    meta = build_attention_metadata(tables, [0] * len(lengths), list(lengths), "cpu")
    rand = lambda n, h: torch.randn(n, h, head_dim, generator=g).bfloat16()  # noqa: E731
    qkv = [first] + [(rand(n, num_q_heads), rand(n, num_kv_heads), rand(n, num_kv_heads)) for n in lengths[1:]]
    write_kv(torch.cat([k for _, k, _ in qkv]), torch.cat([v for _, _, v in qkv]), k_cache, v_cache, meta.slot_mapping)
    return torch.cat([q for q, _, _ in qkv]), k_cache, v_cache, meta


@pytest.mark.parametrize("heads,lengths", [((12, 2, 128), (124, 221)), ((12, 2, 16), (70, 140))],
                         ids=["qwen2.5-1.5b", "d16"])
def test_a_prompt_beside_another_gets_bitwise_its_attention_alone(heads, lengths):
    """Two prompts prefilled in one step (two requests arriving together): each gets bitwise the
    attention it gets alone, in an SDPA call of its own. Padded into one masked call beside the
    other, the rows differed in the last bits (each case here did), and a greedy answer parted
    from the same prompt's alone (a HumanEval stream at its 169th token, a 0.12-nat margin)."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(0)
    first = tuple(torch.randn(lengths[0], h, d, generator=g).bfloat16() for h in (hq, hkv, hkv))
    scale = d**-0.5
    alone = paged_attention(*_prompts_case(first, [], *heads), scale)
    for others in ([lengths[1]], [lengths[1], 33]):
        together = paged_attention(*_prompts_case(first, others, *heads), scale)
        assert torch.equal(together[: lengths[0]], alone), others


def test_paged_attention_dispatches_to_reference_on_cpu():
    query, cache, meta, _ = build_case(4, 2, torch.float32)
    args = (query, *cache.layer(0), meta, 0.2)
    torch.testing.assert_close(paged_attention(*args), paged_attention_ref(*args), atol=0, rtol=0)


def test_gqa_head_mismatch_is_a_value_error():
    query, cache, meta, _ = build_case(4, 1, torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_ref(query[:, :1].expand(-1, 3, -1), *cache.layer(0), meta, 0.2)


needs_triton = pytest.mark.skipif(
    not triton_available()
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="triton is not installed (pip install 'specdec[triton]'), or neither CUDA nor "
    "TRITON_INTERPRET=1 is available",
)


def _on_device(query, cache, meta):
    if not torch.cuda.is_available():
        return query, cache.layer(0), meta
    from dataclasses import replace

    tensors = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    meta = replace(meta, **{f: getattr(meta, f).cuda() for f in tensors})
    return query.cuda(), tuple(c.cuda() for c in cache.layer(0)), meta


@needs_triton
@GRID
@pytest.mark.parametrize("windows", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_matches_reference(block_size, group, dtype, windows):
    query, cache, meta, per_seq = build_case(block_size, group, dtype, windows=windows)
    scale = HEAD_DIM**-0.5
    ref = paged_attention_ref(query, *cache.layer(0), meta, scale)
    query, (k_cache, v_cache), meta = _on_device(query, cache, meta)
    out = paged_attention_triton(query, k_cache, v_cache, meta, scale).cpu()
    assert out.dtype == dtype
    tol = TOL[dtype]  # fp32 dots are IEEE on the GPU too (not TF32)
    torch.testing.assert_close(out.double(), expected_output(per_seq, scale), **tol)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_with_fp8_kv(dtype):
    kv_scale = 0.5
    query, cache, meta, per_seq = build_case(4, 2, dtype, FP8, kv_scale)
    scale = HEAD_DIM**-0.5
    query, (k_cache, v_cache), meta = _on_device(query, cache, meta)
    out = paged_attention_triton(query, k_cache, v_cache, meta, scale, kv_scale, kv_scale).cpu()
    exact = expected_output(per_seq, scale, lambda x: _fp8_roundtrip(x, kv_scale))
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=2e-2)


@needs_triton
def test_triton_handles_empty_windows():
    windows = [(12, 3), (7, 0), (20, 3)]
    query, cache, meta, per_seq = build_case(4, 2, torch.float32, windows=windows)
    query, (k_cache, v_cache), meta = _on_device(query, cache, meta)
    out = paged_attention_triton(query, k_cache, v_cache, meta, HEAD_DIM**-0.5).cpu()
    torch.testing.assert_close(
        out.double(), expected_output(per_seq, HEAD_DIM**-0.5), atol=2e-2, rtol=2e-2
    )


@needs_triton
def test_triton_refuses_tensors_on_different_devices():
    query, cache, meta, _ = build_case(4, 2, torch.float32)
    with pytest.raises(ValueError, match="share one device"):
        paged_attention_triton(query, *(c.to("meta") for c in cache.layer(0)), meta, 0.2)
