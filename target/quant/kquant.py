"""GGUF blocks repacked into `QLinear` tiles that `qgemm` reads as they are: the k-quants Q4_K, Q5_K,
Q6_K, Q3_K, Q2_K and IQ4_XS (super-blocks of 256 inputs), Q5_0, Q4_0, Q4_1, IQ4_NL, MXFP4 and
Q8_0 (blocks of 32), and the float types F16 and BF16 (their 16-bit values, input by input: a
tile holds `[K, 16]` of them, `FLOAT_KINDS`).

The file's quantized weights are not re-quantized: their integers, 6-bit (Q4_K) or int8 (Q6_K)
sub-scales and fp16 scales move into the tile layouts of `kquant_tiles.h` and `block32_tiles.h`,
16 output channels to a tile, with the file's bytes per weight (`BLOCK_BYTES` per block). So the
weights the kernel multiplies by are exactly the file's (`dequantize_tiles` gives back
`gguf.quants.dequantize`'s values, tested), and loading is a reshuffle of bytes.

    >>> tiles = pack_kquant(raw_rows, TILE_Q4_K)   # doctest: +SKIP  (raw_rows [N, K / 256 * 144] uint8)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec import native
from specdec.kernel_abi import (GROUP, SUPER, TILE, TILE_BF16, TILE_F16, TILE_IQ4_NL, TILE_IQ4_XS, TILE_MXFP4,
                                TILE_Q2_K, TILE_Q3_K, TILE_Q4_0, TILE_Q4_1, TILE_Q4_K, TILE_Q5_0, TILE_Q5_K, TILE_Q6_K,
                                TILE_Q8_0, raise_for_status)

# bytes per block of BLOCK_INPUTS weights in the file and in a tile (per output channel): equal
BLOCK_BYTES = {TILE_Q4_K: 144, TILE_Q5_K: 176, TILE_Q6_K: 210, TILE_Q5_0: 22, TILE_Q4_0: 18, TILE_Q4_1: 20,
               TILE_IQ4_NL: 18, TILE_MXFP4: 17, TILE_IQ4_XS: 136, TILE_Q3_K: 110, TILE_Q2_K: 84, TILE_Q8_0: 34,
               TILE_F16: 64, TILE_BF16: 64}
BLOCK_INPUTS = {TILE_Q4_K: SUPER, TILE_Q5_K: SUPER, TILE_Q6_K: SUPER, TILE_Q5_0: GROUP, TILE_Q4_0: GROUP,
                TILE_Q4_1: GROUP, TILE_IQ4_NL: GROUP, TILE_MXFP4: GROUP, TILE_IQ4_XS: SUPER,
                TILE_Q3_K: SUPER, TILE_Q2_K: SUPER, TILE_Q8_0: GROUP, TILE_F16: GROUP, TILE_BF16: GROUP}
# ggml's type id of a GGUF tensor -> the tile kind that holds its blocks as stored (the same number but Q8_0's)
GGML_KINDS = {12: TILE_Q4_K, 13: TILE_Q5_K, 14: TILE_Q6_K, 6: TILE_Q5_0, 2: TILE_Q4_0, 3: TILE_Q4_1, 20: TILE_IQ4_NL,
              39: TILE_MXFP4, 23: TILE_IQ4_XS, 11: TILE_Q3_K, 10: TILE_Q2_K, 8: TILE_Q8_0, 1: TILE_F16,
              30: TILE_BF16}
KIND_NAMES = {TILE_Q4_K: "Q4_K", TILE_Q5_K: "Q5_K", TILE_Q6_K: "Q6_K", TILE_Q5_0: "Q5_0", TILE_Q4_0: "Q4_0",
              TILE_Q4_1: "Q4_1", TILE_IQ4_NL: "IQ4_NL", TILE_MXFP4: "MXFP4", TILE_IQ4_XS: "IQ4_XS",
              TILE_Q3_K: "Q3_K", TILE_Q2_K: "Q2_K", TILE_Q8_0: "Q8_0", TILE_F16: "F16", TILE_BF16: "BF16"}
# float kinds: the file's 16-bit values, multiplied by the activations in fp32 (no activation quantization)
FLOAT_KINDS = frozenset((TILE_F16, TILE_BF16))
# block32_tiles.h's: blocks of 32 inputs, their nibbles in the int4 tiles' layout, then d (and m)
BLOCK32_KINDS = frozenset((TILE_Q5_0, TILE_Q4_0, TILE_Q4_1, TILE_IQ4_NL, TILE_MXFP4))
# the 16 values of a table kind's 4-bit codes (ggml's kvalues_iq4nl, kvalues_mxfp4: e2m1 doubled)
TABLES = {TILE_IQ4_NL: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
          TILE_MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)}
# kinds whose activations the kernel quantizes per 256 inputs (Q8_K); the others per 32, as int4 / int8
SUPER_KINDS = frozenset(k for k, n in BLOCK_INPUTS.items() if n == SUPER)
ROWS_PER_CHUNK = 4096  # output channels repacked at once by torch: ~10 MB of temporaries for K = 1536
# the same packing in C (plain C, any x86-64): ~1 GB/s where torch's ops manage 60-150 MB/s
PACKER = native.NativeKernel((Path(__file__).with_name("kquant_pack.c"),), (), (), ("kquant_pack", "gguf_rows"))


def ggml_type_name(ggml_type: int) -> str:
    """A GGUF tensor type's name as llama.cpp writes it ("Q3_K", "IQ4_XS", "BF16"); the number where gguf
    does not know it."""
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tile_bytes(kind: int, in_features: int) -> int:
    """Bytes of one tile of `kind` over `in_features` inputs."""
    return TILE * in_features // BLOCK_INPUTS[kind] * BLOCK_BYTES[kind]


def fits(kind: int, out_features: int, in_features: int) -> bool:
    """Whether a `[out_features, in_features]` tensor of `kind` fills whole tiles."""
    return kind in BLOCK_BYTES and out_features % TILE == 0 and in_features % BLOCK_INPUTS[kind] == 0


def pack_kquant(raw: np.ndarray | torch.Tensor, kind: int) -> torch.Tensor:
    """`raw [N, K / inputs per block * block bytes]` uint8, a GGUF tensor's rows of `kind` (a
    `BLOCK_BYTES` kind) -> the tiles `[N / 16 * tile_bytes]` uint8: in C (`kquant_pack.c`) where
    it builds, else in torch a chunk of rows at a time (`pack_kquant_torch`)."""
    rows = raw if isinstance(raw, np.ndarray) else raw.numpy()
    n, k = rows.shape[0], rows.shape[1] // BLOCK_BYTES[kind] * BLOCK_INPUTS[kind]
    if kind in FLOAT_KINDS:
        return pack_kquant_torch(rows, kind)
    lib = PACKER.load()
    if lib is None or not fits(kind, n, k):
        return pack_kquant_torch(rows, kind)
    rows = np.ascontiguousarray(rows)  # a view of the mapped file as it lies: no copy
    out = torch.empty(n // TILE * tile_bytes(kind, k), dtype=torch.uint8)
    rc = lib.kquant_pack(rows.ctypes.data, rows.strides[0], n, k, kind, out.data_ptr(), torch.get_num_threads())
    raise_for_status(rc, "kquant_pack")
    return out


def pack_kquant_torch(raw: np.ndarray | torch.Tensor, kind: int) -> torch.Tensor:
    """`pack_kquant` in torch ops (the reference the C packer is tested against)."""
    n = raw.shape[0]
    pack = {TILE_Q4_K: _pack_q4_k, TILE_Q5_K: _pack_q5_k, TILE_Q6_K: _pack_q6_k, TILE_Q5_0: _pack_q5_0,
            TILE_Q4_0: _pack_q4_0, TILE_Q4_1: _pack_q4_1, TILE_IQ4_NL: _pack_iq4_nl, TILE_MXFP4: _pack_mxfp4,
            TILE_IQ4_XS: _pack_iq4_xs, TILE_Q3_K: _pack_q3_k, TILE_Q2_K: _pack_q2_k,
            TILE_Q8_0: _pack_q8_0, TILE_F16: _pack_float, TILE_BF16: _pack_float}[kind]
    return torch.cat([pack(_rows(raw[r : r + ROWS_PER_CHUNK])) for r in range(0, n, ROWS_PER_CHUNK)])


def _pack_float(rows: torch.Tensor) -> torch.Tensor:
    """F16 / BF16 rows `[n, 2 K]` bytes -> tiles of `[K, 16]` 16-bit values (16 output channels an
    input), so the kernel multiplies one input into 16 channels with one load."""
    n = rows.shape[0]
    values = rows.view(torch.int16).view(n // TILE, TILE, -1)  # [t, 16, K]
    return values.transpose(1, 2).contiguous().view(torch.uint8).reshape(-1)


def _rows(raw: np.ndarray | torch.Tensor) -> torch.Tensor:  # a chunk as a writable tensor (a mapped file's is copied)
    if isinstance(raw, torch.Tensor):
        return raw.contiguous()
    return torch.from_numpy(raw if raw.flags.writeable and raw.flags.c_contiguous else np.array(raw))


def _blocks(rows: torch.Tensor, kind: int) -> torch.Tensor:  # [n, S * bytes] -> [n, S, bytes]
    return rows.view(rows.shape[0], -1, BLOCK_BYTES[kind])


def _int4_layout(q: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` 0..15 -> `[N/16, K/8, 64]`: per block of 8 inputs, byte 4n + i = q[n][8b + i] |
    q[n][8b + 4 + i] << 4 (the int4 tiles' blocks, qlinear.pack_int4)."""
    n, k = q.shape
    q6 = q.view(n // TILE, TILE, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [t, b, n, i, h]
    return (q6[..., 0] | (q6[..., 1] << 4)).reshape(n // TILE, k // 8, 64)


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K `[n, S, 144]` -> q `[n, 256 S]` 0..15, sc and m `[n, S, 8]` 0..63, d and dmin `[n, S]`
    as fp16 bits (int16)."""
    n, s = blocks.shape[:2]
    d = blocks[..., 0:2].contiguous().view(torch.int16).view(n, s)
    dmin = blocks[..., 2:4].contiguous().view(torch.int16).view(n, s)
    a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), -1)  # [n, S, 8]
    m = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), -1)
    qs = blocks[..., 16:].reshape(n, s, 4, 32)
    q = torch.stack((qs & 0x0F, qs >> 4), 3).reshape(n, 256 * s)  # sub-block 2i: low nibbles of group i
    return q, sc, m, d, dmin


def q5_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q5_K `[n, S, 176]` (d, dmin, scales[12] as Q4_K's, qh[32], qs[128]) -> q4_k_parts' tuple with
    q 0..31: bit 2g + h of qh[l] is the top bit of weight 64 g + 32 h + l."""
    n, s = blocks.shape[:2]
    low, sc, m, d, dmin = q4_k_parts(torch.cat((blocks[..., :16], blocks[..., 48:]), -1))
    qh = blocks[..., 16:48].unsqueeze(2) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)  # [n, S, 2g + h, l]
    return low | ((qh & 1) << 4).reshape(n, 256 * s), sc, m, d, dmin


def q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K `[n, S, 210]` -> q `[n, 256 S]` 0..63, sc `[n, S, 16]` int8, d `[n, S]` fp16 bits."""
    n, s = blocks.shape[:2]
    ql = blocks[..., :128].reshape(n, s, 2, 2, 32)  # [n, S, half, ql byte group, l]
    low = torch.stack((ql & 0x0F, ql >> 4), 3).reshape(n, s, 2, 4, 32)  # values 0-31, 32-63, 64-95, 96-127 of a half
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    top = (blocks[..., 128:192].reshape(n, s, 2, 1, 32) >> shifts) & 3  # [n, S, half, 4, 32]
    q = (low | (top << 4)).reshape(n, 256 * s)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)  # [n, S, 16]
    d = blocks[..., 208:210].contiguous().view(torch.int16).view(n, s)
    return q, sc, d


def _per_tile(v: torch.Tensor) -> torch.Tensor:
    """`[N, S, j]` -> `[N/16, S, j, 16]` (outputs last: one vector of 16 per j) as bytes."""
    n, s = v.shape[:2]
    return v.reshape(n // TILE, TILE, s, -1).permute(0, 2, 3, 1).contiguous()


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:  # [N, S] int16 -> [N/16, S, 32] bytes
    return _per_tile(v.unsqueeze(-1)).view(torch.uint8).reshape(v.shape[0] // TILE, v.shape[1], 32)


def _pack_q4_k(rows: torch.Tensor) -> torch.Tensor:
    return _pack_q4_k_parts(*q4_k_parts(_blocks(rows, TILE_Q4_K)))


def _pack_q4_k_parts(q, sc, m, d, dmin) -> torch.Tensor:
    t, s = q.shape[0] // TILE, q.shape[1] // SUPER
    weights = _int4_layout(q).view(t, s, 2048)
    sc_t, m_t = _per_tile(sc), _per_tile(m)  # [t, S, 8, 16]
    low = ((sc_t & 15) | ((m_t & 15) << 4)).view(t, s, 128)
    hi = ((sc_t >> 4) | ((m_t >> 4) << 2)).view(t, s, 4, 2, 16)  # [t, S, j/2, j odd, n]
    top = (hi[:, :, :, 0] | (hi[:, :, :, 1] << 4)).view(t, s, 64)
    return torch.cat((weights, low, top, _fp16_bytes(d), _fp16_bytes(dmin)), -1).reshape(-1)


def _pack_q5_k(rows: torch.Tensor) -> torch.Tensor:
    """Q4_K's super-block of the low nibbles, then per sub-block of 32 the top bits in Q5_0's plane."""
    q, sc, m, d, dmin = q5_k_parts(_blocks(rows, TILE_Q5_K))
    t, s = q.shape[0] // TILE, q.shape[1] // SUPER
    head = _pack_q4_k_parts(q & 15, sc, m, d, dmin).view(t, s, 2304)
    return torch.cat((head, _top_plane(q).view(t, s, 512)), -1).reshape(-1)


def _top_plane(q: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` -> `[N/16, K/32, 64]`: per 32 inputs, bit 2b + h of byte 4n + i = the top bit (bit 4)
    of q[n][32 g + 8 b + 4 h + i] (Q5_0's and Q5_K's plane)."""
    t, g = q.shape[0] // TILE, q.shape[1] // GROUP
    hi = (q >> 4).view(t, TILE, g, 4, 2, 4).permute(0, 2, 1, 5, 3, 4).reshape(t, g, 64, 8)
    return (hi << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _pack_q6_k(rows: torch.Tensor) -> torch.Tensor:
    q, sc, d = q6_k_parts(_blocks(rows, TILE_Q6_K))
    t, s, k = q.shape[0] // TILE, q.shape[1] // SUPER, q.shape[1]
    low = _int4_layout(q & 15)  # [t, K/8, 64]
    # vector v = 2 * part + half of a block: part 0 the inputs 8b + i, part 1 8b + 4 + i; value 4n' + i
    hi = (q >> 4).view(t, 2, 8, k // 8, 2, 4).permute(0, 3, 4, 1, 2, 5).reshape(t, k // 8, 4, 32)
    top = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [t, K/8, 32]
    blocks = torch.cat((low, top), -1).view(t, s, 32 * 96)
    scales = _per_tile(sc).view(torch.uint8).view(t, s, 256)
    return torch.cat((blocks, scales, _fp16_bytes(d)), -1).reshape(-1)


def q5_0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 `[n, G, 22]` -> q `[n, 32 G]` 0..31 (w = d * (q - 16)), d `[n, G]` as fp16 bits."""
    n, g = blocks.shape[:2]
    d = blocks[..., 0:2].contiguous().view(torch.int16).view(n, g)
    qh = blocks[..., 2:6].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)  # [n, G, 4, 8]: bit j = weight j's
    high = (qh & 1).reshape(n, g, 32)
    qs = blocks[..., 6:22]
    q = torch.cat((qs & 0x0F, qs >> 4), -1) | (high << 4)  # weights 0-15 in the low nibbles, 16-31 high
    return q.reshape(n, 32 * g), d


def _pack_q5_0(rows: torch.Tensor) -> torch.Tensor:
    q, d = q5_0_parts(_blocks(rows, TILE_Q5_0))
    t, g = q.shape[0] // TILE, q.shape[1] // GROUP
    low = _int4_layout(q & 15).view(t, g, 256)
    return torch.cat((low, _top_plane(q), _fp16_bytes(d)), -1).reshape(-1)


def q4_0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_0 `[n, G, 18]` (d, qs[16]) or Q4_1 `[n, G, 20]` (d, m, qs[16]) -> q `[n, 32 G]` 0..15
    (weights 0-15 in the low nibbles, 16-31 high), d and m (Q4_1; else None) `[n, G]` fp16 bits."""
    n, g, nbytes = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.int16).view(n, g)
    m = blocks[..., 2:4].contiguous().view(torch.int16).view(n, g) if nbytes == 20 else None
    qs = blocks[..., nbytes - 16 :]
    return torch.cat((qs & 0x0F, qs >> 4), -1).reshape(n, 32 * g), d, m


def _pack_q4_0(rows: torch.Tensor, kind: int = TILE_Q4_0) -> torch.Tensor:
    q, d, m = q4_0_parts(_blocks(rows, kind))
    t, g = q.shape[0] // TILE, q.shape[1] // GROUP
    parts = [_int4_layout(q).view(t, g, 256), _fp16_bytes(d)] + ([] if m is None else [_fp16_bytes(m)])
    return torch.cat(parts, -1).reshape(-1)


def _pack_q4_1(rows: torch.Tensor) -> torch.Tensor:
    return _pack_q4_0(rows, TILE_Q4_1)


def _pack_iq4_nl(rows: torch.Tensor) -> torch.Tensor:  # d, qs[16]: Q4_0's bytes, the codes looked up
    return _pack_q4_0(rows, TILE_IQ4_NL)


def _pack_mxfp4(rows: torch.Tensor) -> torch.Tensor:
    """MXFP4 `[n, G, 17]` (e, qs[16]): the codes in the int4 layout, then e[16]."""
    blocks = _blocks(rows, TILE_MXFP4)
    n, g = blocks.shape[:2]
    qs = blocks[..., 1:]
    q = torch.cat((qs & 0x0F, qs >> 4), -1).reshape(n, 32 * g)
    e = _per_tile(blocks[..., 0:1].contiguous()).reshape(n // TILE, g, TILE)
    return torch.cat((_int4_layout(q).view(n // TILE, g, 256), e), -1).reshape(-1)


def iq4_xs_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """IQ4_XS `[n, S, 136]` (d, scales_h, scales_l[4], qs[128]) -> codes `[n, 256 S]` 0..15, ls
    `[n, S, 8]` 0..63 (w = d * (ls - 32) * kvalues_iq4nl[code]), d `[n, S]` fp16 bits."""
    n, s = blocks.shape[:2]
    d = blocks[..., 0:2].contiguous().view(torch.int16).view(n, s)
    high = blocks[..., 2:4].to(torch.int32)
    high = high[..., 0] | (high[..., 1] << 8)  # [n, S] uint16 scales_h
    low = blocks[..., 4:8].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)  # [n, S, 4, 2]
    top = (high.unsqueeze(-1) >> (2 * torch.arange(8, dtype=torch.int32))) & 3  # [n, S, 8]
    ls = (low.reshape(n, s, 8) & 15) | (top.to(torch.uint8) << 4)
    qs = blocks[..., 8:].reshape(n, s, 8, 16)
    q = torch.cat((qs & 15, qs >> 4), -1).reshape(n, 256 * s)
    return q, ls, d


def _pack_iq4_xs(rows: torch.Tensor) -> torch.Tensor:
    q, ls, d = iq4_xs_parts(_blocks(rows, TILE_IQ4_XS))
    t, s = q.shape[0] // TILE, q.shape[1] // SUPER
    ls_t = _per_tile(ls)  # [t, S, 8, 16]
    low = ((ls_t[:, :, 0::2] & 15) | ((ls_t[:, :, 1::2] & 15) << 4)).reshape(t, s, 64)
    hi = (ls_t >> 4).view(t, s, 2, 4, TILE) << (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
    top = hi.sum(3, dtype=torch.uint8).reshape(t, s, 32)
    return torch.cat((_int4_layout(q).view(t, s, 2048), low, top, _fp16_bytes(d)), -1).reshape(-1)


def q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q3_K `[n, S, 110]` (hmask[32], qs[64], scales[12], d) -> q `[n, 256 S]` 0..7 (w = d * (sc - 32) *
    (q - 4)), sc `[n, S, 16]` 0..63, d `[n, S]` fp16 bits."""
    n, s = blocks.shape[:2]
    low = blocks[..., 32:96].reshape(n, s, 2, 1, 32) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
    third = blocks[..., 0:32].reshape(n, s, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)  # [n, S, 4h + j, l]
    q = ((low & 3).reshape(n, s, 8, 32) | ((third & 1) << 2)).reshape(n, 256 * s)
    sb = blocks[..., 96:108]
    lows = (sb[..., :8].unsqueeze(2) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)).reshape(n, s, 16) & 15
    tops = (sb[..., 8:].unsqueeze(2) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)).reshape(n, s, 16) & 3
    d = blocks[..., 108:110].contiguous().view(torch.int16).view(n, s)
    return q, lows | (tops << 4), d


def q2_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q2_K `[n, S, 84]` (scales[16], qs[64], d, dmin) -> q `[n, 256 S]` 0..3, the scale bytes `[n, S, 16]`
    (sc | m << 4), d and dmin `[n, S]` fp16 bits."""
    n, s = blocks.shape[:2]
    q = (blocks[..., 16:80].reshape(n, s, 2, 1, 32) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)) & 3
    d = blocks[..., 80:82].contiguous().view(torch.int16).view(n, s)
    dmin = blocks[..., 82:84].contiguous().view(torch.int16).view(n, s)
    return q.reshape(n, 256 * s), blocks[..., 0:16], d, dmin


def _two_bit_plane(q: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` -> `[N/16, K/16, 64]`: byte 4n + i of pair P, bits 2 (2b + h): the low 2 bits of
    q[n][16 P + 8 b + 4 h + i]."""
    n, k = q.shape
    v = (q & 3).view(n // TILE, TILE, k // 16, 2, 2, 4).permute(0, 2, 1, 5, 3, 4).reshape(n // TILE, k // 16, 64, 4)
    return (v << (2 * torch.arange(4, dtype=torch.uint8))).sum(-1, dtype=torch.uint8)


def _from_two_bit_plane(plane: torch.Tensor) -> torch.Tensor:  # [t, P, 64] -> [16 t, 16 P] 0..3
    t, pairs = plane.shape[:2]
    v = (plane.view(t, pairs, TILE, 4, 1) >> (2 * torch.arange(4, dtype=torch.uint8))) & 3  # [t, P, n, i, 2b + h]
    return v.view(t, pairs, TILE, 4, 2, 2).permute(0, 2, 1, 4, 5, 3).reshape(t * TILE, pairs * 16)


def _pack_q3_k(rows: torch.Tensor) -> torch.Tensor:
    q, sc, d = q3_k_parts(_blocks(rows, TILE_Q3_K))
    t, s = q.shape[0] // TILE, q.shape[1] // SUPER
    sc_t = _per_tile(sc)  # [t, S, 16, 16]
    low = ((sc_t[:, :, 0::2] & 15) | ((sc_t[:, :, 1::2] & 15) << 4)).reshape(t, s, 128)
    top = ((sc_t >> 4).view(t, s, 4, 4, TILE) << (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1))
    parts = (_two_bit_plane(q).view(t, s, 1024), _top_plane((q >> 2) << 4).view(t, s, 512), low,
             top.sum(3, dtype=torch.uint8).reshape(t, s, 64), _fp16_bytes(d))
    return torch.cat(parts, -1).reshape(-1)


def _pack_q2_k(rows: torch.Tensor) -> torch.Tensor:
    q, sb, d, dmin = q2_k_parts(_blocks(rows, TILE_Q2_K))
    t, s = q.shape[0] // TILE, q.shape[1] // SUPER
    parts = (_two_bit_plane(q).view(t, s, 1024), _per_tile(sb).reshape(t, s, 256), _fp16_bytes(d), _fp16_bytes(dmin))
    return torch.cat(parts, -1).reshape(-1)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's e8m0_to_fp32_half: uint8 exponents -> 2^(e - 128) fp32, subnormal below e = 2."""
    x = e.to(torch.int32)
    bits = torch.where(x < 2, torch.tensor(0x00200000, dtype=torch.int32) << x, (x - 1) << 23)
    return bits.view(torch.float32)


def _pack_q8_0(rows: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(rows, TILE_Q8_0)
    n, g = blocks.shape[:2]
    t = n // TILE
    d = blocks[..., 0:2].contiguous().view(torch.int16).view(n, g)
    q = (blocks[..., 2:] ^ 0x80).view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512)  # q + 128
    return torch.cat((q, _fp16_bytes(d)), -1).reshape(-1)


def dequantize_tiles(tiles: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
    """The weights `[16 * tiles, K]` fp32 that `tiles` of one GGUF kind hold (tests, reports):
    read back from the tile layout, so a packing error shows as a difference from the file's."""
    if kind in BLOCK32_KINDS or kind == TILE_Q8_0:
        return _dequantize_block32(tiles, kind, in_features)
    if kind in FLOAT_KINDS:  # [t, K, 16] 16-bit values -> [16 t, K]
        values = tiles.view(torch.float16 if kind == TILE_F16 else torch.bfloat16).view(-1, in_features, TILE)
        return values.transpose(1, 2).reshape(-1, in_features).float()
    s = in_features // SUPER
    per = tile_bytes(kind, in_features) // s
    b = tiles.view(-1, s, per)  # [t, S, bytes]
    t = b.shape[0]

    def untile(v: torch.Tensor) -> torch.Tensor:  # [t, S, j, 16] -> [16 t, S, j]
        return v.permute(0, 3, 1, 2).reshape(t * TILE, s, -1)

    def fp16(v: torch.Tensor) -> torch.Tensor:  # [t, S, 32] bytes -> [16 t, S, 1] fp32
        return untile(v.contiguous().view(torch.float16).view(t, s, 1, TILE)).float()

    if kind in (TILE_Q3_K, TILE_Q2_K):
        q = _from_two_bit_plane(b[..., :1024].reshape(t, s * 16, 64))
        if kind == TILE_Q2_K:
            sb = untile(b[..., 1024:1280].reshape(t, s, 16, 16))
            w = (fp16(b[..., 1280:1312]) * (sb & 15).float())[..., None] * q.view(-1, s, 16, 16).float()
            w = w - (fp16(b[..., 1312:1344]) * (sb >> 4).float())[..., None]
            return w.reshape(-1, in_features)
        q = (q | (_from_top_plane(b[..., 1024:1536].reshape(t, s * 8, 64)) << 2)).float() - 4
        pairs = b[..., 1536:1664].reshape(t, s, 8, 1, 16) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        top = b[..., 1664:1728].reshape(t, s, 4, 1, 16) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
        sc = (pairs.reshape(t, s, 16, 16) & 15) | ((top.reshape(t, s, 16, 16) & 3) << 4)
        w = (fp16(b[..., 1728:1760]) * (untile(sc).float() - 32))[..., None] * q.view(-1, s, 16, 16)
        return w.reshape(-1, in_features)
    if kind == TILE_IQ4_XS:
        v = torch.tensor(TABLES[TILE_IQ4_NL], dtype=torch.float32)[_from_int4_layout(b[..., :2048].reshape(t, -1, 64)).long()]
        pairs = b[..., 2048:2112].reshape(t, s, 4, 1, 16) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        top = b[..., 2112:2144].reshape(t, s, 2, 1, 16) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
        ls = (pairs.reshape(t, s, 8, 16) & 15) | ((top.reshape(t, s, 8, 16) & 3) << 4)
        w = (fp16(b[..., 2144:2176]) * (untile(ls).float() - 32))[..., None] * v.view(-1, s, 8, 32)
        return w.reshape(-1, in_features)
    if kind in (TILE_Q4_K, TILE_Q5_K):
        q = _from_int4_layout(b[..., :2048].reshape(t, -1, 64))
        if kind == TILE_Q5_K:
            q = q | (_from_top_plane(b[..., 2304:].reshape(t, s * 8, 64)) << 4)
        low = b[..., 2048:2176].reshape(t, s, 8, 16)
        top = b[..., 2176:2240].reshape(t, s, 4, 1, 16) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        top = top.reshape(t, s, 8, 16)
        sc = untile((low & 15) | ((top & 3) << 4)).float()
        m = untile((low >> 4) | (((top >> 2) & 3) << 4)).float()
        w = (fp16(b[..., 2240:2272]) * sc)[..., None] * q.view(-1, s, 8, 32) - (fp16(b[..., 2272:2304]) * m)[..., None]
        return w.reshape(-1, in_features)
    blocks = b[..., :3072].reshape(t, -1, 96)  # [t, K/8, 96]
    low = _from_int4_layout(blocks[..., :64])
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    hi = (blocks[..., 64:].unsqueeze(2) >> shifts) & 3  # [t, K/8, 4, 32]
    hi = hi.view(t, -1, 2, 2, 8, 4).permute(0, 3, 4, 1, 2, 5).reshape(t * TILE, in_features)
    q = (low | (hi << 4)).float() - 32
    sc = untile(b[..., 3072:3328].contiguous().view(torch.int8).view(t, s, 16, 16)).float()
    w = (fp16(b[..., 3328:3360]) * sc)[..., None] * q.view(-1, s, 16, 16)
    return w.reshape(-1, in_features)


def _dequantize_block32(tiles: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
    g = in_features // GROUP
    b = tiles.view(-1, g, tile_bytes(kind, in_features) // g)  # [t, G, bytes]
    t = b.shape[0]
    d = b[..., -32:].contiguous().view(torch.float16).permute(0, 2, 1).reshape(t * TILE, g, 1).float()
    if kind == TILE_Q8_0:
        q = b[..., :512].reshape(t, g, 8, TILE, 4).permute(0, 3, 1, 2, 4).float() - 128
        return (d * q.reshape(t * TILE, g, GROUP)).reshape(-1, in_features)
    low = _from_int4_layout(b[..., :256].reshape(t, -1, 64))  # [16 t, K]
    if kind == TILE_Q5_0:
        q = (low | (_from_top_plane(b[..., 256:320]) << 4)).float() - 16
    elif kind in TABLES:
        q = torch.tensor(TABLES[kind], dtype=torch.float32)[low.long()]
        if kind == TILE_MXFP4:
            d = e8m0_half(b[..., 256:272]).permute(0, 2, 1).reshape(t * TILE, g, 1)
        else:
            d = b[..., 256:288].contiguous().view(torch.float16).permute(0, 2, 1).reshape(t * TILE, g, 1).float()
    else:
        q = low.float() - (8 if kind == TILE_Q4_0 else 0)
        d = b[..., 256:288].contiguous().view(torch.float16).permute(0, 2, 1).reshape(t * TILE, g, 1).float()
    w = d * q.view(t * TILE, g, GROUP)
    if kind == TILE_Q4_1:
        w = w + b[..., 288:320].contiguous().view(torch.float16).permute(0, 2, 1).reshape(t * TILE, g, 1).float()
    return w.reshape(-1, in_features)


def _from_top_plane(plane: torch.Tensor) -> torch.Tensor:  # [t, G, 64] -> the top bits [16 t, 32 G] (`_top_plane`)
    t, g = plane.shape[:2]
    bits = (plane.reshape(t, g, TILE, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [t, G, n, i, 2b + h]
    return bits.view(t, g, TILE, 4, 4, 2).permute(0, 2, 1, 4, 5, 3).reshape(t * TILE, g * GROUP)


def _from_int4_layout(blocks: torch.Tensor) -> torch.Tensor:  # [t, K/8, 64] -> q [16 t, K] uint8
    t, nb = blocks.shape[:2]
    b = blocks.view(t, nb, TILE, 4)  # [t, b, n, i]
    return torch.stack((b & 15, b >> 4), -2).permute(0, 2, 1, 3, 4).reshape(t * TILE, nb * 8)
