"""KVCacheSpec / PagedKVCache sizing and views; write_kv scatter, including fp8 with scales."""

import pytest
import torch

from specdec.cache import KVCacheSpec, PagedKVCache, write_kv

FP8 = torch.float8_e4m3fn


def _spec(dtype=torch.bfloat16, **kw):
    args = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    args.update(kw)
    return KVCacheSpec(**args)


def test_bytes_per_block_counts_layers_keys_values():
    assert _spec().bytes_per_block() == 3 * 2 * 4 * 2 * 8 * 2
    assert _spec(dtype=FP8).bytes_per_block() * 2 == _spec().bytes_per_block()


def test_a_latent_cache_holds_one_plane_whose_first_dims_are_the_values():
    """Multi-head latent attention: one "head" of rank + rope a token, no separate values; the
    values are a view of the latents' first rank dims, and blocks travel as one plane."""
    import numpy as np

    from specdec.cache import BlockPool
    from specdec.cache.transfer import read_blocks, transit_shape, write_held_block

    spec = _spec(num_kv_heads=1, head_dim=24, latent_rank=16)
    assert spec.planes == 1 and spec.bytes_per_token() == 3 * 24 * 2 and spec.bytes_per_block() == 4 * 3 * 24 * 2
    cache = PagedKVCache(spec, 5)
    assert cache.kv.shape == (3, 1, 5, 4, 1, 24)
    k, v = cache.layer(2)
    k[1, 2, 0] = torch.arange(24, dtype=torch.bfloat16)
    assert v.shape == (5, 4, 1, 16) and torch.equal(v[1, 2, 0], torch.arange(16, dtype=torch.bfloat16))
    data = read_blocks(cache, [1])
    assert data.shape == transit_shape(spec, 1) == (3, 1, 1, 4, 1, 48)
    other = PagedKVCache(spec, 5)
    block = write_held_block(BlockPool(5), other, np.asarray(data))
    assert torch.equal(other.kv[:, :, block], cache.kv[:, :, 1])
    for bad in (dict(latent_rank=25), dict(num_kv_heads=2, latent_rank=16)):
        with pytest.raises(ValueError, match="latent cache"):
            _spec(**{"num_kv_heads": 1, "head_dim": 24, **bad})


def test_from_memory_budget_fits_the_budget():
    spec = _spec()
    cache = PagedKVCache.from_memory_budget(spec, 10 * spec.bytes_per_block() + 7)
    assert cache.num_blocks == 10
    assert cache.kv.shape == (3, 2, 10, 4, 2, 8) and cache.kv.dtype == torch.bfloat16
    assert cache.nbytes() <= 10 * spec.bytes_per_block() + 7


def test_budget_below_one_block_is_a_clear_error():
    spec = _spec()
    with pytest.raises(ValueError, match="below one block"):
        PagedKVCache.from_memory_budget(spec, spec.bytes_per_block() - 1)


def test_bad_spec_and_scale_raise_value_error():
    with pytest.raises(ValueError, match="block_size"):
        _spec(block_size=0)
    with pytest.raises(ValueError, match="floating"):
        _spec(dtype=torch.int8)
    with pytest.raises(ValueError, match="kv_scale"):
        PagedKVCache(_spec(), 2, kv_scale=0.0)


def test_layer_views_share_storage():
    cache = PagedKVCache(_spec(dtype=torch.float32), num_blocks=2)
    k_cache, v_cache = cache.layer(1)
    assert k_cache.shape == (2, 4, 2, 8)
    k_cache.fill_(1.0)
    v_cache.fill_(2.0)
    assert cache.kv[1, 0].eq(1).all() and cache.kv[1, 1].eq(2).all() and cache.kv[0].eq(0).all()
    with pytest.raises(ValueError, match="layer 3"):
        cache.layer(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatters_to_slots(dtype):
    cache = PagedKVCache(_spec(dtype=dtype, num_layers=1), num_blocks=3)
    k_cache, v_cache = cache.layer(0)
    key, value = torch.randn(2, 5, 2, 8)  # [T, Hkv, D] each
    slots = torch.tensor([11, 0, 4, 5, 7])
    write_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.reshape(12, 2, 8)
    flat_v = v_cache.reshape(12, 2, 8)
    torch.testing.assert_close(flat_k[slots], key.to(dtype))
    torch.testing.assert_close(flat_v[slots], value.to(dtype))
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert flat_k[untouched].eq(0).all()


def test_write_kv_fp8_stores_value_over_scale():
    cache = PagedKVCache(_spec(dtype=FP8, num_layers=1), num_blocks=2, kv_scale=0.25)
    k_cache, v_cache = cache.layer(0)
    key = torch.tensor([0.5, -1.0, 2.0, 100.0]).repeat(2, 2, 2)  # [T=2, Hkv=2, D=8]
    value = torch.full((2, 2, 8), 0.75)
    write_kv(key, value, k_cache, v_cache, torch.tensor([1, 6]), cache.k_scale, cache.v_scale)
    stored_k = k_cache.reshape(8, 2, 8)[[1, 6]]
    assert stored_k.dtype == FP8
    # 100 / 0.25 = 400 fits e4m3 up to rounding; read back = stored * scale
    torch.testing.assert_close(stored_k.float() * 0.25, key, rtol=0.07, atol=0)
    torch.testing.assert_close(v_cache.reshape(8, 2, 8)[[1, 6]].float(), value / 0.25)


def test_write_kv_fp8_saturates_instead_of_nan():
    cache = PagedKVCache(_spec(dtype=FP8, num_layers=1), num_blocks=1)
    k_cache, v_cache = cache.layer(0)
    big = torch.full((1, 2, 8), 1e6)
    write_kv(big, -big, k_cache, v_cache, torch.tensor([0]))
    assert k_cache[0, 0].float().eq(448).all() and v_cache[0, 0].float().eq(-448).all()


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_cache_needs_compute_capability_8_9(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    make = lambda: KVCacheSpec(2, 2, 8, 4, torch.float8_e4m3fn, device="cuda")  # noqa: E731
    if refused:
        with pytest.raises(ValueError, match="compute capability 8.9"):
            make()
    else:
        assert make().is_fp8


def test_a_cpu_cache_starts_zeroed_in_every_dtype():
    """Its pages come from calloc (taken as tokens arrive), but it reads as zeros everywhere."""
    from specdec.cache.kv_cache import _zeros

    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        kv = _zeros((2, 2, 3, 4, 1, 8), dtype, "cpu")
        assert kv.dtype == dtype and kv.shape == (2, 2, 3, 4, 1, 8) and kv.is_contiguous()
        assert not kv.float().any()
        kv[1, 0, 2] = 1  # writable
        assert kv.float().sum() == 4 * 8
