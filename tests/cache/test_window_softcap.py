"""Sliding windows and attention soft-capping in paged attention (reference and Triton) against
dense attention: a query at position p sees keys in (p - window, p]; scores are capped at
softcap * tanh(score / softcap) before the softmax."""

import pytest
import torch

from specdec.cache import paged_attention_ref, paged_attention_triton
from tests.cache.test_paged_attention import (
    DECODE, HEAD_DIM, MIXED, TOL, _on_device, build_case, needs_triton,
)

CASES = [(None, None), (7, None), (32, None), (None, 5.0), (7, 5.0), (1, None)]
IDS = [f"w{w}-cap{c}" for w, c in CASES]


def dense_attention(q, k, v, scale, window=None, softcap=None):
    """q [Q, Hq, D] (the last Q positions) over k, v [L, Hkv, D], in float64."""
    num_queries, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(seq_len - num_queries, seq_len)[:, None]  # [Q, 1]
    keys = torch.arange(seq_len)[None, :]
    visible = keys <= query_pos
    if window is not None:
        visible &= keys > query_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [Q, Hq, D]


def expected(per_seq, scale, window, softcap):
    return torch.cat([dense_attention(q, k, v, scale, window, softcap) for q, k, v in per_seq])


@pytest.mark.parametrize("window,softcap", CASES, ids=IDS)
@pytest.mark.parametrize("windows", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size,group", [(1, 2), (4, 1), (16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_honours_window_and_softcap(window, softcap, windows, block_size, group, dtype):
    query, cache, meta, per_seq = build_case(block_size, group, dtype, windows=windows)
    scale = HEAD_DIM**-0.5
    out = paged_attention_ref(query, *cache.layer(0), meta, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected(per_seq, scale, window, softcap), **TOL[dtype])


def test_a_window_longer_than_every_sequence_changes_nothing():
    query, cache, meta, _ = build_case(4, 2, torch.float32)
    scale = HEAD_DIM**-0.5
    plain = paged_attention_ref(query, *cache.layer(0), meta, scale)
    windowed = paged_attention_ref(query, *cache.layer(0), meta, scale, window=10_000)
    assert torch.equal(plain, windowed)


def test_layers_with_different_windows_share_metadata():
    """The plan cached in `meta.scratch` by one layer must not leak into a layer with another window."""
    query, cache, meta, per_seq = build_case(4, 2, torch.float32)
    scale = HEAD_DIM**-0.5
    for window in (None, 7, None, 3):
        out = paged_attention_ref(query, *cache.layer(0), meta, scale, window=window)
        torch.testing.assert_close(out.double(), expected(per_seq, scale, window, None), **TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("window,softcap", CASES, ids=IDS)
@pytest.mark.parametrize("windows", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_honours_window_and_softcap(window, softcap, windows, dtype):
    query, cache, meta, per_seq = build_case(4, 2, dtype, windows=windows)
    scale = HEAD_DIM**-0.5
    query, (k_cache, v_cache), meta = _on_device(query, cache, meta)
    out = paged_attention_triton(query, k_cache, v_cache, meta, scale, window=window, softcap=softcap).cpu()
    torch.testing.assert_close(out.double(), expected(per_seq, scale, window, softcap), **TOL[dtype])
