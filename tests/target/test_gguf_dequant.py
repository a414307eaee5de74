"""The torch GGUF dequantizer is bitwise identical to the gguf package's numpy one, for every type it
reads itself, on random blocks that cover every code, negative and extreme scales, odd row counts and
rows that straddle chunk boundaries."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specdec.target import gguf_dequant
from specdec.target.gguf_dequant import dequantize

# byte offsets of the fp16 scales in each block (d, then m / dmin)
SCALE_BYTES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
               T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
BLOCK_TYPES = list(SCALE_BYTES)


def random_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 of both signs spanning subnormals to the largest (no NaN / inf)."""
    bits = rng.integers(0, 0x7C00, size=n, dtype=np.uint16)  # exponent < 31: finite
    bits |= rng.integers(0, 2, size=n, dtype=np.uint16) << 15
    bits[: n // 4] = np.array([0x0001, 0x8001, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00, 0x0000, 0x8000], np.uint16)[
        np.arange(n // 4) % 8]  # smallest subnormal, largest finite, +-1, +-0
    rng.shuffle(bits)
    return bits


def random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """`[rows, row_bytes]` uint8: random bytes (every quant code) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for at in SCALE_BYTES[qtype]:
        raw[:, at : at + 2] = random_fp16(rng, raw.shape[0]).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def quantized(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Weights quantized by the gguf package itself, per-row magnitudes from 1e-6 to 1e4, both signs."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-6, 4, size=(rows, 1))
    return gguf.quants.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), qtype)


def assert_bitwise(raw: np.ndarray, qtype: T) -> None:
    with np.errstate(all="ignore"):
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype)))
    got = dequantize(raw, qtype)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), qtype.name


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_random_blocks_bitwise(qtype: T, rows: int) -> None:
    assert_bitwise(random_blocks(qtype, rows, blocks_per_row=3, seed=rows), qtype)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_gguf_quantized_bitwise(qtype: T) -> None:
    assert_bitwise(quantized(qtype, rows=33, cols=96), qtype)


def test_float_types_bitwise() -> None:
    rng = np.random.default_rng(1)
    assert_bitwise(rng.standard_normal((5, 24)).astype(np.float32), T.F32)
    every_fp16 = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = every_fp16[(every_fp16 & 0x7C00) != 0x7C00]
    assert_bitwise(finite[: 1 << 15].view(np.float16).reshape(128, -1), T.F16)
    assert_bitwise(finite.view(np.uint8)[: 1 << 14].reshape(64, -1), T.BF16)  # every bf16 bit pattern, incl NaN


def test_chunks_and_read_only_map(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Rows split over many chunks (a chunk not dividing the rows) from a read-only memory map."""
    monkeypatch.setattr(gguf_dequant, "CHUNK_WEIGHTS", 3 * 256)
    raw = random_blocks(T.Q4_K, rows=11, blocks_per_row=1, seed=5)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, mode="r", dtype=np.uint8).reshape(raw.shape)
    assert_bitwise(mapped, T.Q4_K)
    assert_bitwise(random_blocks(T.Q6_K, rows=13, blocks_per_row=2, seed=6), T.Q6_K)


def test_leading_dims_and_fallback() -> None:
    """A 1-D vector keeps its shape; a type without a torch path (Q2_K) goes through gguf."""
    assert_bitwise(random_blocks(T.Q8_0, rows=1, blocks_per_row=4)[0], T.Q8_0)
    raw = np.random.default_rng(2).integers(0, 256, size=(3, 84), dtype=np.uint8)
    raw[:, 80:84] = random_fp16(np.random.default_rng(3), 6).view(np.uint8).reshape(3, 4)
    assert_bitwise(raw, T.Q2_K)


def test_bad_row_length() -> None:
    with pytest.raises(ValueError, match="whole 144-byte blocks"):
        dequantize(np.zeros((2, 145), dtype=np.uint8), T.Q4_K)
