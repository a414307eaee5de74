"""`QLinear`: a linear layer on the group-quantized CPU kernel (`qgemm.c`): quantization `"w4a8"`.

Weights: per group of 32 inputs, int4 where the weights sit on a 16-level grid (GGUF Q4_K: exact)
and int8 elsewhere (Q6_K tensors, the LM head): 5 and 9 bits per weight with their bf16 scales.
Activations: int8 per row and group of 32, quantized inside the kernel. One kernel call per linear
(the RMSNorm or SiLU-GLU before it, activation quantization, GEMM, bias, the residual add and the
output cast included), its cost flat from 1 to ~4 rows, results bitwise independent of the other
rows in the batch.

Output channels come in tiles of 16, each int4 or int8 on its own, so q/k/v and gate/up fuse by
concatenating tiles whatever format each part took.

A GGUF's tensors of the types `kquant.KIND_NAMES` lists skip all of that (`from_gguf`): their
blocks are repacked into tiles of those formats (`kquant.py`) with the file's bytes, read as they
are by the kernel, activations then quantized per 256 inputs for the k-quants and IQ4_XS
(llama.cpp's Q8_K), per 32 for the blocks of 32. They fuse with the other formats the same way.
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import torch
from torch import nn

from specdec.kernel_abi import SUPER, TILE_Q8_0, check_tensor, raise_for_status
from specdec.target.quant import kquant
from specdec.target.quant.int4 import chunk_rows, quantize_int4
from specdec.target.quant.int8 import cat_biases
from specdec.target.quant.qgemm import FLOATS, GROUP_BYTES, TILE_KINDS, check_weights, require_qgemm, tile_size

# The tile layout's sizes, spelled here because this file keys the quantized cache
# (`cache_file.LAYOUT_SOURCES`); equal to kernel_abi.h's SPECDEC_GROUP / SPECDEC_TILE (tested).
GROUP = 32  # inputs per weight and activation group
TILE = 16  # output channels per tile


class QLinear(nn.Module):
    """`y = x @ w.T + b` on `qgemm`; see the module docstring for the formats."""

    fuses_rmsnorm = True  # forward(x, norm_weight, eps) computes RMSNorm(x) inside the kernel
    fuses_epilogue = True  # forward(x, residual=, glu=) adds the residual / takes silu(gate) * up

    def __init__(
        self, tiles: torch.Tensor, tile_offsets: torch.Tensor, tile_bits: torch.Tensor,
        in_features: int, bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("tiles", tiles)  # [bytes] uint8, the tiles end to end
        self.register_buffer("tile_offsets", tile_offsets)  # [N/16] int64 byte offsets
        self.register_buffer("tile_bits", tile_bits)  # [N/16] uint8: 4 or 8
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)  # [N]
        self.in_features, self.out_features = in_features, TILE * tile_bits.numel()
        self._lib = require_qgemm()
        self._checked: tuple = ()  # weak references to the buffers `check_weights` last passed

    def __getstate__(self):  # the ctypes library cannot be copied or pickled: reload it instead
        return {k: v for k, v in super().__getstate__().items() if k not in ("_lib", "_checked")}

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._lib, self._checked = require_qgemm(), ()

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether `weight [N, K]` fills whole tiles and groups (N % 16 == K % 32 == 0)."""
        n, k = weight.shape
        return n % TILE == 0 and k % GROUP == 0

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, int4_max_error: float) -> "QLinear":
        """Quantize `weight [N, K]`: int4 (asymmetric, bf16 step and zero) where its relative error
        stays under `int4_max_error`, else int8 (symmetric, bf16 step). Needs N % 16 == K % 32 == 0."""
        n, k = weight.shape
        if not cls.fits(weight):
            raise ValueError(
                f"QLinear needs out_features % {TILE} == 0 and in_features % {GROUP} == 0, got {n}x{k}"
            )
        int4 = quantize_int4(weight, GROUP, int4_max_error)
        if int4 is not None:
            q4, sz = int4
            step, zero = sz.transpose(0, 1).unbind(-1)  # [N, G] bf16 each
            tiles = pack_int4(q4, step, zero)
            bits = 4
        else:
            tiles = quantize_pack_int8(weight)
            bits = 8
        t = n // TILE
        size = tiles.numel() // t
        offsets = torch.arange(t, dtype=torch.int64) * size
        return cls(tiles, offsets, torch.full((t,), bits, dtype=torch.uint8), k, bias)

    @classmethod
    def from_gguf(cls, raw, kind: int, in_features: int, bias: torch.Tensor | None) -> "QLinear":
        """From a GGUF tensor's blocks as stored, `raw [N, K / inputs per block * block bytes]`
        uint8 of tile `kind` (`kquant.GGML_KINDS[ggml type]`, one of `kquant.KIND_NAMES`): repacked,
        not re-quantized (`kquant`)."""
        n = raw.shape[0]
        if not kquant.fits(kind, n, in_features):
            inputs = kquant.BLOCK_INPUTS.get(kind, SUPER)
            raise ValueError(f"GGUF tiles need a tensor of one of {sorted(kquant.KIND_NAMES.values())} with "
                             f"out_features % {TILE} == 0 and in_features % {inputs} == 0, got tile kind {kind}, "
                             f"{n}x{in_features}")
        tiles = kquant.pack_kquant(raw, kind)
        size = kquant.tile_bytes(kind, in_features)
        offsets = torch.arange(n // TILE, dtype=torch.int64) * size
        return cls(tiles, offsets, torch.full((n // TILE,), kind, dtype=torch.uint8), in_features, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, int4_max_error: float) -> nn.Module:
        """`from_weight` of `linear`, or `linear` itself where its shape does not fit."""
        w = linear.weight.detach()
        return cls.from_weight(w, linear.bias, int4_max_error) if cls.fits(w) else linear

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor | None], in_features: int, bias: torch.Tensor | None
    ) -> "QLinear":
        """From the tensors a cache file holds (`formats.QLINEAR.state_keys`)."""
        return cls(tensors["tiles"], tensors["tile_offsets"], tensors["tile_bits"], in_features, bias)

    def forward(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        glu: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`x [..., K] -> [..., N]`, in one kernel call with what is fused into it:
        `norm_weight [K]`: of `RMSNorm(x)`; `glu`: of `silu(gate) * up` where `x [..., 2K]` is
        `gate | up`; `residual [..., N]` (x's dtype): `residual + linear(...)`. `out_dtype`
        (bf16 or fp32; None: x's dtype): the kernel's output as it comes out, not rounded to x's
        dtype (a tensor-parallel rank's part of a sum)."""
        if glu and norm_weight is not None:
            raise ValueError("the kernel fuses either an RMSNorm or a SiLU-GLU before a linear, not both")
        k = 2 * self.in_features if glu else self.in_features
        if x.device.type != "cpu":
            raise ValueError(f"x must be on the CPU for the C kernel, got {x.device}")
        if x.shape[-1] != k:
            raise ValueError(f"x must have {k} features{' (gate | up)' if glu else ''}, got {x.shape[-1]}")
        x2 = x.reshape(-1, k)  # [M, K] (or [M, 2K])
        if x2.dtype not in FLOATS:
            x2 = x2.float()
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=out_dtype or x2.dtype)  # [M, N]
        if residual is not None:
            if residual.device.type != "cpu" or residual.numel() != y.numel():
                raise ValueError(f"residual must be a CPU tensor of {y.numel()} elements [..., {self.out_features}], "
                                 f"got {list(residual.shape)} on {residual.device}")
            residual = residual.reshape(y.shape).to(y.dtype).contiguous()
        if norm_weight is not None:
            check_tensor("norm_weight", norm_weight, FLOATS, (k,))
        self._check_weights()
        if x2.shape[0]:
            rc = self._lib.qgemm(
                x2.data_ptr(), x2.dtype == torch.bfloat16, x2.shape[0], self.in_features, glu,
                self.tiles.data_ptr(), self.tile_offsets.data_ptr(), self.tile_bits.data_ptr(),
                self.out_features, None if self.bias is None else self.bias.data_ptr(),
                None if residual is None else residual.data_ptr(), y.data_ptr(), y.dtype == torch.bfloat16,
                None if norm_weight is None else norm_weight.data_ptr(),
                norm_weight is not None and norm_weight.dtype == torch.bfloat16, eps, torch.get_num_threads(),
            )
            raise_for_status(rc, "qgemm")
        return y.reshape(*x.shape[:-1], self.out_features).to(out_dtype or x.dtype)

    def _check_weights(self) -> None:
        """`check_weights` on the buffers, once per set of buffers (`.to()`, `pack_tiles` and
        friends replace them)."""
        buffers = (self.tiles, self.tile_offsets, self.tile_bits, self.bias)
        if len(self._checked) != 4 or any(ref() is not b for ref, b in zip(self._checked, buffers)):
            check_weights(*buffers, self.in_features, self.out_features)
            self._checked = tuple(_no_ref if b is None else weakref.ref(b) for b in buffers)

    def extra_repr(self) -> str:
        counts = {TILE_KINDS[b]: n for b, n in zip(*(v.tolist() for v in self.tile_bits.unique(return_counts=True)))}
        return f"in={self.in_features}, out={self.out_features}, tiles={counts}"


def take_rows(module: QLinear, ids: torch.Tensor) -> QLinear:
    """A `QLinear` of `module`'s output rows `ids [R]` (R % 16 == 0), exactly: the integers and
    scales of int4 / int8 / Q8_0 tiles are moved, not re-quantized (a head over part of a
    vocabulary: `draft.vocab`). Other tiles (Q4_K, Q6_K, Q5_0, mixed formats) are dequantized and
    quantized again."""
    if ids.numel() % TILE:
        raise ValueError(f"rows are taken in whole tiles of {TILE}, got {ids.numel()}")
    bias = None if module.bias is None else module.bias[ids]
    kinds = set(module.tile_bits.tolist())
    if len(kinds) != 1 or kinds - {4, 8, TILE_Q8_0}:
        return QLinear.from_weight(dequantize(module)[ids], bias, int4_max_error=0.02)
    bits = kinds.pop()
    k, g, size, count = module.in_features, module.in_features // GROUP, tile_size(bits, module.in_features), len(ids)
    whole = _whole_tiles(module, size).view(-1, g, size // g)  # [T, g, group bytes]
    t, n = ids // TILE, ids % TILE  # each row's tile and its place there

    def steps(at: int, dtype: torch.dtype) -> torch.Tensor:  # [R, g] row n's 2-byte values at byte `at` of each group
        return whole[t, :, at : at + 32].contiguous().view(dtype).gather(2, n[:, None, None].expand(-1, g, 1)).squeeze(2)

    if bits == 4:
        b = whole[:, :, :256].view(-1, g, 4, TILE, 4)[t, :, :, n]  # [R, g, b, i]
        q = torch.stack([b & 15, b >> 4], -2).reshape(count, k)  # k = 32 g + 8 b + 4 h + i
        tiles = pack_int4(q, steps(256, torch.bfloat16), steps(288, torch.bfloat16))
    else:  # int8 or Q8_0 (bf16 or fp16 steps): the bytes moved as they are
        b = whole[:, :, :512].view(-1, g, 8, TILE, 4)[t, :, :, n]  # [R, g, b, i]
        tcount = count // TILE
        w = b.reshape(tcount, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(tcount, g, 512)
        s = steps(512, torch.int16).view(tcount, TILE, g).permute(0, 2, 1).contiguous().view(torch.uint8)
        tiles = torch.cat([w, s.view(tcount, g, 32)], -1).reshape(-1)
    t = len(ids) // TILE
    offsets = torch.arange(t, dtype=torch.int64) * tile_size(bits, k)
    return QLinear(tiles, offsets, torch.full((t,), bits, dtype=torch.uint8), k, bias)


def input_step(module: QLinear) -> int:
    """The inputs of one block of `module`'s formats (256 where a tile is a k-quant, else 32):
    `take_inputs` cuts at multiples of it."""
    return SUPER if set(module.tile_bits.tolist()) & kquant.SUPER_KINDS else GROUP


def take_output_tiles(module: QLinear, ranges: list[tuple[int, int]]) -> QLinear:
    """A `QLinear` of `module`'s output rows `[start, end)` of each range, end to end (multiples of
    16: whole tiles), the tiles' bytes as they are (a tensor-parallel rank's heads)."""
    if any(a % TILE or b % TILE or not 0 <= a <= b <= module.out_features for a, b in ranges):
        raise ValueError(f"rows are taken in whole tiles of {TILE} within {module.out_features}, got {ranges}")
    tiles = [t for a, b in ranges for t in range(a // TILE, b // TILE)]
    offsets, bits = module.tile_offsets.tolist(), module.tile_bits.tolist()
    parts = [module.tiles[offsets[t] : offsets[t] + tile_size(bits[t], module.in_features)] for t in tiles]
    rows = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.empty(0, dtype=torch.long)
    bias = None if module.bias is None else module.bias[rows].clone()
    return QLinear(torch.cat(parts), _offsets(parts), module.tile_bits[tiles].clone(), module.in_features, bias)


def take_inputs(module: QLinear, start: int, end: int, bias: bool = True) -> QLinear:
    """A `QLinear` over `module`'s inputs `[start, end)` (multiples of `input_step`): each tile's
    blocks there, as they are (a tensor-parallel rank's part of a row-parallel linear); without
    `bias` none (the ranks' parts are summed: one of them adds it)."""
    k, step = module.in_features, input_step(module)
    if start % step or end % step or not 0 <= start < end <= k:
        raise ValueError(f"inputs are taken in blocks of {step} within {k}, got [{start}, {end})")
    parts = []
    for offset, b in zip(module.tile_offsets.tolist(), module.tile_bits.tolist()):
        record = tile_size(b, k) // (k // _block_inputs(b))  # a tile is its blocks along K, in order
        parts.append(module.tiles[offset + start // _block_inputs(b) * record : offset + end // _block_inputs(b) * record])
    keep = module.bias.clone() if bias and module.bias is not None else None
    return QLinear(torch.cat(parts), _offsets(parts), module.tile_bits.clone(), end - start, keep)


def _block_inputs(bits: int) -> int:
    return kquant.BLOCK_INPUTS.get(bits, GROUP)


def _offsets(parts: list[torch.Tensor]) -> torch.Tensor:
    sizes = torch.tensor([0] + [p.numel() for p in parts[:-1]], dtype=torch.int64)
    return torch.cumsum(sizes, 0)


def _whole_tiles(module: QLinear, size: int) -> torch.Tensor:
    """`[T, size]` module's tiles in output order (a view where they lie in order, as packed)."""
    t = module.tile_offsets.numel()
    if torch.equal(module.tile_offsets, torch.arange(t, dtype=torch.int64) * size):
        return module.tiles[: t * size].view(t, size)
    return torch.stack([module.tiles[o : o + size] for o in module.tile_offsets.tolist()])


def _no_ref() -> None:  # the weak reference to an absent bias
    return None


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of 32: `(q [N, K] int32 in -127..127, step [N, K/32] bf16)`.

    In chunks of ~1M weights whose temporaries stay in cache (whole-tensor temporaries made the
    default target's LM head and Q6_K tensors take 7.6 s of its first load)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32)
    step = torch.empty(n, k // GROUP, dtype=torch.bfloat16)
    rows = chunk_rows(k)
    for r in range(0, n, rows):
        w = weight[r : r + rows].float().view(-1, k // GROUP, GROUP)  # [rows, G, 32]
        s = step[r : r + rows]  # [rows, G]
        s.copy_((w.abs().amax(-1) / 127).clamp_(min=1e-30))
        q[r : r + rows] = torch.div(w, s.float()[..., None]).round_().clamp_(-127, 127).view(-1, k)
    return q, step


def quantize_pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` -> int8 tiles `[N/16 * K/32 * 544]` uint8 (`quantize_int8_groups` then
    `pack_int8`), a few tiles' rows at a time: whole-tensor int32 temporaries took 3 GB beside the
    default target's 151,936 x 1,536 LM head (most of its first load's peak memory)."""
    n, k = weight.shape
    tile_bytes = k // GROUP * GROUP_BYTES[8]
    out = torch.empty(n // TILE * tile_bytes, dtype=torch.uint8)
    rows = max(TILE, chunk_rows(k) // TILE * TILE)
    for r in range(0, n, rows):
        q, step = quantize_int8_groups(weight[r : r + rows])
        end = min(n, r + rows)
        out[r // TILE * tile_bytes : end // TILE * tile_bytes].copy_(pack_int8(q, step))
    return out


def pack_int4(q: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` in 0..15, `step, zero [N, K/32]` bf16 -> tiles `[N/16 * K/32 * 320]` uint8."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    # k = 32 g + 8 b + 4 h + i; byte (b, 4 n + i) holds h=0 in its low nibble, h=1 in its high one
    q6 = q.to(torch.uint8).view(t, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [t, g, b, n, i, h]
    weights = (q6[..., 0] | (q6[..., 1] << 4)).reshape(t, g, 256)
    return torch.cat([weights, _tile_scales(step, t, g), _tile_scales(zero, t, g)], -1).reshape(-1)


def pack_int8(q: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` in -127..127, `step [N, K/32]` bf16 -> tiles `[N/16 * K/32 * 544]` uint8."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    q5 = (q + 128).to(torch.uint8).view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4)  # [t, g, b, n, i]
    return torch.cat([q5.reshape(t, g, 512), _tile_scales(step, t, g)], -1).reshape(-1)


def _tile_scales(s: torch.Tensor, t: int, g: int) -> torch.Tensor:  # [N, G] bf16 -> [t, g, 32] bytes
    s = s.to(torch.bfloat16).contiguous().view(t, TILE, g).permute(0, 2, 1).contiguous()  # [t, g, 16]
    return s.view(torch.uint8).view(t, g, 32)


def fuse_qlinear(parts: list[nn.Module]) -> QLinear | None:
    """One `QLinear` whose output is the parts' outputs end to end (same input), or None unless all
    parts are `QLinear` of one input size. Exact: tiles are independent."""
    if not all(isinstance(p, QLinear) for p in parts) or len({p.in_features for p in parts}) != 1:
        return None
    offsets, start = [], 0
    for p in parts:
        offsets.append(p.tile_offsets + start)
        start += p.tiles.numel()
    return QLinear(
        torch.cat([p.tiles for p in parts]), torch.cat(offsets), torch.cat([p.tile_bits for p in parts]),
        parts[0].in_features, cat_biases(parts, torch.float32),
    )


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory advised for transparent huge pages (Linux), else `t` itself.

    A forward streams every tile once (~1.2 GB for the target); on 4 KiB pages the hardware
    prefetchers stop at each page boundary and the TLB misses. 2 MiB pages made the target's GEMMs
    ~7% faster here. Costs one copy at load.
    """
    buf = _huge_page_buffer(t.numel() * t.element_size())
    if buf is None:
        return t
    buf.copy_(t.reshape(-1).view(torch.uint8))  # first touch: the pages fault in huge
    return buf.view(t.dtype).view(t.shape)


def _huge_page_buffer(n: int) -> torch.Tensor | None:
    """`n` uninitialized bytes, 2 MiB aligned and advised for huge pages; None where that is not
    possible or not worth it (under 2 MiB). The pages fault in (huge) on first write."""
    if not sys.platform.startswith("linux") or n < _HUGE_PAGE:
        return None
    buf = torch.empty(n + _HUGE_PAGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % _HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    length = (n + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    length = min(length, buf.numel() - start) // 4096 * 4096
    if libc.madvise(ctypes.c_void_p(buf.data_ptr() + start), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
        return None
    return buf[start : start + n]


def pack_tiles(modules: list[QLinear]) -> None:
    """Move the modules' tiles into one arena on huge pages (`to_huge_pages`), end to end in the
    given order: the order a forward reads them, so one stream runs through the whole model and
    matrices under 2 MiB (a draft's q/k/v and o) get huge pages too. A/B on the default draft:
    a forward 11.5 -> 11.0 ms for 1 row, 16.1 -> 15.4 ms for 5."""
    if not modules:
        return
    sizes = [m.tiles.numel() for m in modules]
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // 64) * 64  # cache-line aligned
    arena = _huge_page_buffer(end)
    arena = torch.empty(end, dtype=torch.uint8) if arena is None else arena
    moved = 0
    for m, start, size in zip(modules, starts, sizes):  # the first touch, in the arena's order
        arena[start : start + size].copy_(m.tiles)
        m.tiles = arena[start : start + size]
        moved += size
        if moved >= TRIM_EVERY:  # the old tiles' pages back as the arena's are touched: not 2x the model at the end
            release_freed_memory()
            moved = 0


TRIM_EVERY = 64 << 20


def release_freed_memory() -> None:
    """Hand the memory freed inside glibc's heap back to the system (`malloc_trim`): quantizing
    and packing free thousands of mid-sized tensors whose pages glibc otherwise keeps (1.1 GB of
    them after the default target). Nothing where the C library has no `malloc_trim`."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # no glibc (musl, macOS, Windows)
        pass


def dequantize(module: QLinear) -> torch.Tensor:
    """The weight `[N, K]` fp32 that `module` multiplies by (for tests and error reports)."""
    k, g = module.in_features, module.in_features // GROUP
    rows = []
    for off, bits in zip(module.tile_offsets.tolist(), module.tile_bits.tolist()):
        size = tile_size(bits, k)
        if bits in kquant.BLOCK_BYTES:
            rows.append(kquant.dequantize_tiles(module.tiles[off : off + size], bits, k))
            continue
        tile = module.tiles[off : off + size].view(g, -1)
        if bits == 4:
            b = tile[:, :256].view(g, 4, TILE, 4)  # [g, b, n, i]
            q = torch.stack([b & 15, b >> 4], -2).permute(2, 0, 1, 3, 4).reshape(TILE, k).float()  # [n, k]
            step, zero = (_untile(tile[:, 256 + 32 * j : 288 + 32 * j]) for j in range(2))
            w = (q.view(TILE, g, GROUP) - 8) * step[..., None] + zero[..., None]
        else:
            q = tile[:, :512].view(g, 8, TILE, 4).permute(2, 0, 1, 3).reshape(TILE, k).float() - 128
            w = q.view(TILE, g, GROUP) * _untile(tile[:, 512:544])[..., None]
        rows.append(w.reshape(TILE, k))
    return torch.cat(rows)


def _untile(b: torch.Tensor) -> torch.Tensor:  # [g, 32] bytes -> [16, g] fp32
    return b.contiguous().view(torch.bfloat16).float().t()


def reference_qgemm(x: torch.Tensor, module: QLinear) -> torch.Tensor:
    """What the kernel computes, in torch: x quantized per row and group of 32 (per 256 for
    Q4_K / Q6_K tiles; fp32 for F16 / BF16 tiles), times the weights `dequantize` gives, in fp32 (the kernel matches it up to fp32
    rounding order)."""
    w = dequantize(module)  # [N, K]
    super_kinds = torch.tensor(sorted(kquant.SUPER_KINDS), dtype=module.tile_bits.dtype)
    kquant_cols = torch.isin(module.tile_bits, super_kinds)[:, None].expand(-1, TILE).reshape(-1)  # [N]
    float_kinds = torch.tensor(sorted(kquant.FLOAT_KINDS), dtype=module.tile_bits.dtype)
    float_cols = torch.isin(module.tile_bits, float_kinds)[:, None].expand(-1, TILE).reshape(-1)  # [N]
    y = _fake_quant(x, GROUP) @ w.t()
    if kquant_cols.any():
        y[:, kquant_cols] = _fake_quant(x, SUPER) @ w[kquant_cols].t()
    if float_cols.any():  # F16 / BF16 tiles: the activations as they are
        y[:, float_cols] = x.float() @ w[float_cols].t()
    return y if module.bias is None else y + module.bias


def _fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:  # [M, K]: int8 per row and group, dequantized
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.where(amax > 0, (xg * (127.0 / amax)).round().clamp(-127, 127), torch.zeros_like(xg))
    return (xq * (amax / 127.0)).view(m, k)
