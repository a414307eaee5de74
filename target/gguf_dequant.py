"""GGUF block dequantization in torch, bitwise identical to `gguf.quants.dequantize` and faster.

`gguf.quants` applies numpy ufuncs to 16-row groups of the file's memory map; here the same arithmetic
runs as torch elementwise ops over chunks of rows (torch's threads: on a machine whose cores are busy
with other work, one torch thread beats two, see docs/results/issue17/bench-dequant.md). The results
match the gguf package's bit for bit:

    >>> raw = gguf.quants.quantize(np.random.randn(3, 256).astype(np.float32), GGMLQuantizationType.Q4_K)
    >>> torch.equal(dequantize(raw, GGMLQuantizationType.Q4_K),
    ...             torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_K)))
    True

Block layouts (bytes in storage order; `d`, `m`, `dmin` fp16; a block of 32 or 256 weights):

    Q4_0 [18]  d | qs[16]              w = d * (q - 8)        q: low nibbles = weights 0..15, high 16..31
    Q4_1 [20]  d | m | qs[16]          w = d * q + m
    Q5_0 [22]  d | qh[4] | qs[16]      w = d * (q - 16)       q = nibble | bit j of qh (uint32 LE) << 4
    Q5_1 [24]  d | m | qh[4] | qs[16]  w = d * q + m
    Q8_0 [34]  d | qs[32] int8         w = q * d
    Q4_K [144] d | dmin | scales[12] | qs[128]             8 sub-blocks of 32, 6-bit sc / m each:
               w = (d * sc) * q - (dmin * m)               qs: 4 groups of 32 bytes, low nibbles then high
    Q5_K [176] d | dmin | scales[12] | qh[32] | qs[128]    as Q4_K with q |= bit s of qh[i] << 4
    Q6_K [210] ql[128] | qh[64] | scales[16] int8 | d      16 sub-blocks of 16:
               w = (d * sc) * (q - 32)                     q = nibble of ql | 2 bits of qh << 4

Each product above is exact in float32 (an fp16 scale, 11 significant bits, times integers of at most
7 and 5 bits), so only the final add / subtract rounds, as in numpy; that is why one fused pass
(`addcmul`, FMA or not) gives numpy's bits; fp16 -> fp32 of a scale is exact. A NaN or inf scale
(absent from real files) gives NaN in the same places, but its payload may differ from numpy's.
F32, F16 and BF16 are converted exactly. Any other type (Q2_K, Q3_K, the IQ and TQ types) falls back
to `gguf.quants.dequantize` itself, so every type the gguf package reads is read here.
"""

from __future__ import annotations

from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

CHUNK_WEIGHTS = 1 << 22  # weights per chunk: a few 16 MB float32 temporaries at a time


def dequantize(raw: np.ndarray, ggml_type: int) -> torch.Tensor:
    """`raw` `[..., row_bytes]` (uint8 blocks, or the F16 / F32 values as stored) -> float32 `[..., cols]`,
    bitwise equal to `torch.from_numpy(gguf.quants.dequantize(raw, ggml_type))`."""
    kind = T(ggml_type)
    block = _BLOCKS.get(kind)
    if block is None:
        return torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind), dtype=np.float32))
    data = raw.view(np.uint8)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    if data.shape[-1] % type_size:
        raise ValueError(f"{kind.name} rows of {data.shape[-1]} bytes are not whole {type_size}-byte blocks")
    rows = data.reshape(-1, data.shape[-1])  # [R, row_bytes]
    cols = rows.shape[1] // type_size * block_size
    out = torch.empty(rows.shape[0], cols, dtype=torch.float32)  # [R, cols]
    step = max(1, CHUNK_WEIGHTS // max(cols, 1))
    for r0 in range(0, rows.shape[0], step):
        chunk = _as_tensor(rows[r0 : r0 + step])  # [r, row_bytes]
        blocks = chunk.view(-1, type_size)  # [n, type_size]
        block(blocks, out[r0 : r0 + step].view(blocks.shape[0], block_size))
    return out.view(*data.shape[:-1], cols)


def _as_tensor(rows: np.ndarray) -> torch.Tensor:
    """Rows as a contiguous uint8 tensor; a read-only map (torch cannot share it) is copied, which also
    faults its pages in."""
    if rows.flags.writeable and rows.flags.c_contiguous:
        return torch.from_numpy(rows)
    return torch.from_numpy(np.array(rows, order="C"))


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """fp16 at byte `at` of each block as float32 `[n, 1]` (exact)."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[n, g, k]` bytes -> `[n, g, 2, k]`: low nibbles then high nibbles of each group."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=2)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1 `[n, 4]` bytes of a little-endian uint32 -> bit j of it, `[n, 32]`, shifted to 0x10."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).view(-1, 32) << 4


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 2:].unsqueeze(1)).view(-1, 32).to(torch.int8) - 8  # [n, 32]
    torch.mul(_f16(b, 0), q.float(), out=out)


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 4:].unsqueeze(1)).view(-1, 32).float()  # [n, 32]
    torch.addcmul(_f16(b, 2), _f16(b, 0), q, out=out)  # m + d * q


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = (_nibbles(b[:, 6:].unsqueeze(1)).view(-1, 32) | _high_bits(b[:, 2:6])).to(torch.int8) - 16
    torch.mul(_f16(b, 0), q.float(), out=out)


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = (_nibbles(b[:, 8:].unsqueeze(1)).view(-1, 32) | _high_bits(b[:, 4:8])).float()  # [n, 32]
    torch.addcmul(_f16(b, 2), _f16(b, 0), q, out=out)  # m + d * q


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, 2:].view(torch.int8).float(), _f16(b, 0), out=out)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K `[n, 12]` packed 6-bit scales -> (sc, m), each float32 `[n, 8, 1]`."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _k4(b: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K / Q5_K: `q` float32 `[n, 8, 32]` -> (d * sc) * q - dmin * m, as -(dmin * m) + (d * sc) * q
    in one pass (x - y is x + -y in IEEE, signed zeros included)."""
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = _f16(b, 0).unsqueeze(-1) * sc  # [n, 8, 1]
    dm = _f16(b, 2).unsqueeze(-1) * mn  # [n, 8, 1]
    torch.addcmul(dm.neg_(), d, q, out=out.view(-1, 8, 32))


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 16:].view(-1, 4, 32)).view(-1, 8, 32)  # [n, 8, 32]
    _k4(b, q.float(), out)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    ql = _nibbles(b[:, 48:].view(-1, 4, 32)).view(-1, 8, 32)  # [n, 8, 32]
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    qh = ((b[:, 16:48].unsqueeze(1) >> shifts) & 1) << 4  # [n, 8, 32]: sub-block s takes bit s
    _k4(b, (ql | qh).float(), out)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b, 208) * b[:, 192:208].view(torch.int8).float()  # [n, 16]
    ql = _nibbles(b[:, :128].view(-1, 2, 64)).view(-1, 8, 32)  # [n, 8, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].view(-1, 2, 1, 32) >> shifts) & 3).view(-1, 8, 32)  # [n, 8, 32]
    q = ((ql | (qh << 4)).to(torch.int8) - 32).float()
    torch.mul(d.unsqueeze(-1), q.view(-1, 16, 16), out=out.view(-1, 16, 16))


def _f32(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float32))


def _f16_values(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float16))


def _bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    # bits << 16, as gguf does, rather than a bfloat16 cast that might quiet a NaN
    out.view(torch.int32).copy_(b.view(torch.int16).to(torch.int32) << 16)


_BLOCKS: dict[T, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _f32,
    T.F16: _f16_values,
    T.BF16: _bf16,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
