"""The AVX2 W8A8 kernel (`int8_avx2.c`): `Int8Linear` on it returns fbgemm's outputs bitwise (so
greedy outputs do not change), whatever the thread count, with nothing to pack at load; sizes it
does not take are refused with a `ValueError` or left to fbgemm."""

from __future__ import annotations

import ctypes

import pytest
import torch

from specdec import kernel_abi
from specdec.target.quant import int8, int8_kernel
from specdec.target.quant.int8 import Int8Linear, quantize_int8, uses_int8_kernel

ROWS = [1, 2, 5, 9, 33, 200]
IN_FEATURES = [32, 64, 1536]
OUT_FEATURES = [1, 7, 16, 100, 2048]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    reason = int8_kernel.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the AVX2 int8 kernel cannot run here: {reason}")
    return int8_kernel.load_int8_gemm()


@pytest.fixture
def on_kernel(lib, monkeypatch) -> None:
    """Int8Linear on the kernel, as on AVX2 machines without VNNI. On a VNNI machine fbgemm is held
    to the same 7-bit activations, where its sums are exact too, so the comparison stands."""
    monkeypatch.setattr(int8, "fbgemm_activation_range", lambda: (63.0, 64))
    monkeypatch.setenv("SPECDEC_INT8_KERNEL", "1")
    assert uses_int8_kernel(32)


def _pair(out_features: int, in_features: int, bias: bool, seed: int) -> tuple[Int8Linear, Int8Linear]:
    """(kernel module, fbgemm module) on the same random weights (the first on fbgemm too where
    `in_features` is no multiple of 32)."""
    g = torch.Generator().manual_seed(seed)
    weight_int8, weight_scale = quantize_int8(torch.randn(out_features, in_features, generator=g))
    b = torch.randn(out_features, generator=g) if bias else None
    kernel, fbgemm = Int8Linear(weight_int8, weight_scale, b), Int8Linear(weight_int8, weight_scale, b)
    kernel.prepack()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_NO_KERNELS", "1")  # the path is chosen at prepack
        fbgemm.prepack()
    assert (kernel._packed is kernel.weight_int8) == (in_features % 32 == 0)
    assert not isinstance(fbgemm._packed, torch.Tensor)
    return kernel, fbgemm


def _inputs(rows: int, in_features: int, dtype: torch.dtype, seed: int) -> torch.Tensor:  # [M, K]
    """Normal rows with outlier channels (~100x) and, from two rows on, an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[:, torch.randperm(in_features, generator=g)[:3]] *= 100
    if rows > 1:
        x[1] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_on_the_kernel_equals_fbgemm_bitwise(on_kernel, dtype, bias):
    for k in IN_FEATURES:
        for n in OUT_FEATURES:
            kernel, fbgemm = _pair(n, k, bias, seed=n * k)
            for m in ROWS:
                x = _inputs(m, k, dtype, seed=m)
                y = kernel(x)
                assert y.dtype == dtype and y.shape == (m, n)
                assert torch.equal(y, fbgemm(x)), (m, k, n)


def test_three_d_inputs_and_half_way_activations_match_fbgemm(on_kernel):
    """Leading dimensions fold into rows; activations that land half-way between two integers
    round as fbgemm rounds them (the zero point added before rounding)."""
    kernel, fbgemm = _pair(48, 96, True, seed=3)
    x = torch.randint(-62, 62, (2, 3, 96)).float() + 0.5  # [B, T, K]
    x[..., 0] = 63.0  # amax 63: x is passed on unscaled
    assert torch.equal(kernel(x), fbgemm(x))


def test_ties_and_their_neighbours_round_like_fbgemm(lib):
    """x_scaled at k + 0.5 and one ulp either side: q = nearbyint(float(x + zp)) - zp, fbgemm's rule
    (nearbyint(x) alone differs at 0.5000027, which fp32 rounds to zp + 0.5)."""
    weight_int8, weight_scale = quantize_int8(torch.randn(64, 128))
    fbgemm = Int8Linear(weight_int8, weight_scale, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_NO_KERNELS", "1")
        fbgemm.prepack()
    half = torch.randint(-63, 63, (3, 128)).float() + 0.5
    for x in (half, torch.nextafter(half, half + 1), torch.nextafter(half, half - 1)):  # [3, K]
        x = x.clamp(-63, 63)
        theirs = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 64, fbgemm._packed)
        assert torch.equal(int8_kernel.int8_gemm(x, weight_int8, weight_scale, 64), theirs)


def test_results_do_not_depend_on_the_thread_count(on_kernel):
    kernel, _ = _pair(1000, 1536, True, seed=7)
    x = _inputs(33, 1536, torch.bfloat16, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_in_features_not_a_multiple_of_32_stay_on_fbgemm(on_kernel):
    kernel, fbgemm = _pair(16, 48, False, seed=9)
    assert not isinstance(kernel._packed, torch.Tensor)  # fbgemm's packed weights
    x = _inputs(5, 48, torch.float32, seed=10)
    assert torch.equal(kernel(x), fbgemm(x))


def test_the_kernel_refuses_what_it_does_not_take(lib):
    w, scale = torch.zeros(4, 48, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="multiple of 32|% 32"):
        int8_kernel.int8_gemm(torch.zeros(2, 48), w, scale, 64)
    with pytest.raises(ValueError, match="weight_int8"):
        int8_kernel.int8_gemm(torch.zeros(2, 64), torch.zeros(4, 64), scale, 64)  # fp32 weights
    with pytest.raises(ValueError, match="contiguous"):
        int8_kernel.int8_gemm(torch.zeros(64, 2).t(), torch.zeros(4, 64, dtype=torch.int8), scale, 64)
    y = torch.empty(2, 4)
    rc = lib.int8_gemm_avx2(torch.zeros(2, 48).data_ptr(), 2, 48, w.data_ptr(), scale.data_ptr(), 4,
                            y.data_ptr(), 64, 1)  # past the wrapper: a status, no read past a row
    assert rc == kernel_abi.Status.ERR_INVALID_ARGUMENT


def test_prepack_packs_nothing_on_the_kernel(on_kernel):
    """Loading needs no packing: `_packed` is the weights themselves, so `prepare_quantized`
    (which packs modules whose `_packed` is None) finds nothing left to do."""
    module = Int8Linear(*quantize_int8(torch.randn(64, 256)), None)
    assert module._packed is None
    module.prepack()
    assert module._packed is module.weight_int8
    assert set(module.state_dict()) == {"weight_int8", "weight_scale"}


@pytest.mark.parametrize("isa", ["AVX2", "avx512"])
def test_fbgemm_held_below_vnni_gets_seven_bit_activations(monkeypatch, isa):
    """`FBGEMM_ENABLE_INSTRUCTIONS` makes fbgemm multiply without VNNI on any CPU: its int16 pairs
    then need 7-bit activations, and the AVX2 kernel can stand in for it."""
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", isa)
    assert int8.fbgemm_activation_range() == (63.0, 64)
    assert not int8.uses_int8_kernel(64)  # opt-in
    monkeypatch.setenv("SPECDEC_INT8_KERNEL", "1")
    assert int8.uses_int8_kernel(64) == (int8_kernel.unavailable_reason() is None)
