"""The CPU attention kernel (`paged_attention.c`): rope, KV write and attention in one call.

Cases come from `test_paged_attention.build_case` (prefill, decode and verify windows over
interleaved blocks with garbage in the unused slots); the kernel receives the window's q | k | v
rows and rewrites the window's keys and values itself.
"""

import pytest
import torch

from specdec.cache import cpu_attention, paged_attention_ref, write_kv
from specdec.cache import AttentionMetadata
from specdec.target.rope import apply_rope
from tests.cache.test_paged_attention import DECODE, FP8, HEAD_DIM, MIXED, build_case, expected_output

pytestmark = pytest.mark.skipif(
    cpu_attention.load_attention() is None,
    reason=f"CPU attention kernel unavailable: {cpu_attention.kernel().unavailable_reason() or 'build failed'}",
)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _window_rows(per_seq, meta):
    """The window's q | k | v rows [T, (Hq + 2 Hkv) * D], as a fused projection lays them out."""
    rows = []
    for (q, k, v), query_len in zip(per_seq, meta.query_lens_cpu):
        seq_len = k.shape[0]
        new_k, new_v = k[seq_len - query_len :], v[seq_len - query_len :]
        rows.append(torch.cat([q.flatten(1), new_k.flatten(1), new_v.flatten(1)], dim=1))
    return torch.cat(rows).contiguous()


def _rope_tables(num_positions, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(num_positions, head_dim // 2, generator=g) * 6.3
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], -1)
    return cos.contiguous(), signed_sin.contiguous()


def _run(query, cache, meta, per_seq, rope=None):
    hq, hkv = query.shape[1], cache.layer(0)[0].shape[2]
    qkv = _window_rows(per_seq, meta)
    positions = cos = sin = None
    if rope is not None:
        positions, cos, sin = rope
    out = cpu_attention.rope_write_attend(qkv, hq, hkv, positions, cos, sin, *cache.layer(0), meta, HEAD_DIM**-0.5)
    return out.view(-1, hq, HEAD_DIM), qkv


PREFILL = [(100, 100), (150, 70), (50, 1)]  # a whole prompt, a chunk after cached keys, a stream


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("windows", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
def test_matches_dense_attention_and_the_reference(block_size, group, windows, simd_level):
    query, cache, meta, per_seq = build_case(block_size, group, torch.bfloat16, windows=windows)
    out, _ = _run(query, cache, meta, per_seq)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    scale = HEAD_DIM**-0.5
    torch.testing.assert_close(out.double(), expected_output(per_seq, scale), **BF16_TOL)
    ref = paged_attention_ref(query, *cache.layer(0), meta, scale)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


def test_rope_and_kv_write_are_bitwise_the_torch_path(simd_level):
    """q and k rotated in place, and the cache written, exactly as apply_rope + write_kv do in bf16."""
    query, cache, meta, per_seq = build_case(4, 2, torch.bfloat16, windows=DECODE)
    hq, hkv = query.shape[1], 2
    positions = torch.tensor([p for s, n in DECODE for p in range(s - n, s)], dtype=torch.int64)
    cos, sin = _rope_tables(200, HEAD_DIM)

    rows = _window_rows(per_seq, meta)
    qk = rows[:, : (hq + hkv) * HEAD_DIM].view(-1, hq + hkv, HEAD_DIM)
    rotated = apply_rope(qk, cos[positions].bfloat16().unsqueeze(1), sin[positions].bfloat16().unsqueeze(1))
    expected_cache = cache.kv.clone()
    k_ref, v_ref = expected_cache[0, 0], expected_cache[0, 1]
    v_rows = rows[:, (hq + hkv) * HEAD_DIM :].view(-1, hkv, HEAD_DIM)
    write_kv(rotated[:, hq:], v_rows, k_ref, v_ref, meta.slot_mapping)

    out, qkv = _run(query, cache, meta, per_seq, rope=(positions, cos, sin))
    assert torch.equal(qkv[:, : (hq + hkv) * HEAD_DIM].view(-1, hq + hkv, HEAD_DIM), rotated)
    assert torch.equal(cache.kv, expected_cache)
    ref = paged_attention_ref(rotated[:, :hq].contiguous(), *cache.layer(0), meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


def test_a_rows_result_does_not_depend_on_the_batch(simd_level):
    """Verification of k+1 rows must equal k+1 single-row steps bit for bit (greedy equality)."""
    query, cache, meta, per_seq = build_case(4, 2, torch.bfloat16, windows=DECODE)
    together, qkv = _run(query, cache, meta, per_seq)
    (seq_len, query_len), start = DECODE[1], DECODE[0][1]  # sequence 1: 5 rows after 145 cached
    for i in range(query_len):  # alone, one row at a time, as five decode steps would see it
        row = start + i
        single = AttentionMetadata(
            slot_mapping=meta.slot_mapping[row : row + 1],
            block_tables=meta.block_tables[1:2].contiguous(),
            seq_lens=torch.tensor([seq_len - query_len + i + 1], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            max_query_len=1,
            max_seq_len=seq_len - query_len + i + 1,
            seq_lens_cpu=[seq_len - query_len + i + 1],
            query_lens_cpu=[1],
        )
        out = cpu_attention.rope_write_attend(
            qkv[row : row + 1].clone(), 4, 2, None, None, None, *cache.layer(0), single, HEAD_DIM**-0.5
        )
        assert torch.equal(out.view(4, HEAD_DIM), together[row])


@pytest.mark.parametrize("group", [6, 16])  # Qwen2.5-1.5B's 12 / 2 heads; more than one item's 8
def test_heads_read_together_give_bitwise_what_each_head_gives_alone(group, simd_level):
    """The query heads of a KV head are attended over one read of its keys and values, as many
    at a time as leave every thread an item: one thread takes them all (or 8), 64 threads one each.
    Every head's result is the same bits either way, so the grouping (which depends on the row
    count and the threads) cannot change a token."""
    outs = []
    for threads in (1, 2, 64):
        query, cache, meta, per_seq = build_case(16, group, torch.bfloat16, windows=[(300, 1), (90, 3)])
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(_run(query, cache, meta, per_seq)[0])
        finally:
            torch.set_num_threads(saved)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    torch.testing.assert_close(outs[0].double(), expected_output(per_seq, HEAD_DIM**-0.5), **BF16_TOL)


def test_every_level_computes_bitwise_the_same(monkeypatch):
    """Rope, the KV write and attention of the AVX2 and AVX-VNNI builds are bitwise the AVX-512
    build's (the levels this machine runs: all three on an AVX-512 VNNI CPU)."""
    from tests.conftest import MACHINE_LEVELS

    if len(MACHINE_LEVELS) < 2:
        pytest.skip(f"one level runs here ({MACHINE_LEVELS}): nothing to compare")
    results = {}
    for level in MACHINE_LEVELS:
        monkeypatch.setenv("SPECDEC_ISA", level)
        out = []
        for windows in (MIXED, DECODE):
            for block_size in (1, 16):
                query, cache, meta, per_seq = build_case(block_size, 2, torch.bfloat16, windows=windows)
                positions = torch.tensor([p for s, n in windows for p in range(s - n, s)], dtype=torch.int64)
                att, qkv = _run(query, cache, meta, per_seq, rope=(positions, *_rope_tables(400, HEAD_DIM)))
                out += [att, qkv, cache.kv]
        results[level] = out
    first = MACHINE_LEVELS[0]
    for level in MACHINE_LEVELS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[first], results[level])), (first, level)


def test_bad_indices_are_errors_not_crashes():
    query, cache, meta, per_seq = build_case(4, 2, torch.bfloat16, windows=DECODE)
    cos, sin = _rope_tables(16, HEAD_DIM)  # shorter than the positions used
    positions = torch.tensor([p for s, n in DECODE for p in range(s - n, s)], dtype=torch.int64)
    with pytest.raises(ValueError, match="outside the rotary table"):
        _run(query, cache, meta, per_seq, rope=(positions, cos, sin))
    meta.slot_mapping[0] = 10**9
    with pytest.raises(ValueError, match="slot is outside the KV cache"):
        _run(query, cache, meta, per_seq)


def test_without_the_kernel_the_model_keeps_sdpa_and_a_direct_call_says_why(monkeypatch):
    query, cache, meta, per_seq = build_case(4, 2, torch.bfloat16, windows=DECODE)
    monkeypatch.setenv("SPECDEC_NO_KERNELS", "1")
    assert not cpu_attention.supports(meta, query, cache.layer(0)[0], 1.0, 1.0)
    with pytest.raises(RuntimeError, match="SPECDEC_NO_KERNELS=1"):
        _run(query, cache, meta, per_seq)


def test_prefill_windows_go_to_the_kernel_too():
    query, cache, meta, _ = build_case(4, 2, torch.bfloat16, windows=[(100, 100), (50, 1)])
    assert meta.max_query_len > cpu_attention.MAX_QUERY_LEN  # (the latent kernel's limit, not this one's)
    assert cpu_attention.supports(meta, query, cache.layer(0)[0], 1.0, 1.0)
    _, cache, meta, _ = build_case(4, 2, torch.bfloat16, windows=DECODE)
    assert cpu_attention.supports(meta, query, cache.layer(0)[0], 1.0, 1.0)
    assert not cpu_attention.supports(  # decided once per forward: a fresh step decides again
        build_case(4, 2, torch.bfloat16, FP8, 0.5, windows=DECODE)[2], query, cache.layer(0)[0].to(FP8), 0.5, 0.5
    )
