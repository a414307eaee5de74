"""A GGUF file read lazily: its metadata, its tensor table, and one tensor at a time, dequantized.

The file may be given as its parts, in order (the default pair ships each GGUF as a run of raw
chunks): they are mapped where they lie, never concatenated on disk; a tensor that straddles two
parts is the only thing copied.

`gguf.GGUFReader` builds a Python object per vocabulary entry before it returns (151,936 tokens
and as many merges for Qwen2.5: ~10 s on a quiet core, 35-44 s on a busy one); this reader walks
the same header with `struct`, leaving string arrays as their length (0.2 s), and maps the tensor
data, reading a tensor's pages only when it is dequantized (`gguf.quants.dequantize`, the function
transformers' GGUF loader calls, so values are bitwise those of the former float32 conversion).

    >>> f = GGUFFile.open(path)                 # doctest: +SKIP
    >>> f.metadata["general.architecture"], f.tensors["blk.0.attn_q.weight"].shape
    ('qwen2', (1536, 1536))
    >>> f.dequantize("blk.0.attn_q.weight").dtype
    dtype('float32')
"""

from __future__ import annotations

import ctypes
import functools
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

_MADV_DONTNEED = 4

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor's bytes lie in the file (`start` from the file's beginning)."""

    name: str
    shape: tuple[int, ...]  # torch order: [out, in] for a linear
    ggml_type: int
    start: int
    nbytes: int


class MappedBytes:
    """The bytes of one file, or of several files one after the other, memory-mapped.

    >>> MappedBytes([part1, part2]).slice(start, stop)   # doctest: +SKIP
    memmap([...], dtype=uint8)       # a view where [start, stop) lies in one part, else a copy
    """

    def __init__(self, paths: Sequence[str | Path]) -> None:
        if not paths:
            raise ValueError("a GGUF file needs at least one part")
        self.maps = [np.memmap(p, mode="r", dtype=np.uint8) for p in paths]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])  # [parts + 1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def release_pages(self) -> None:
        """Unmap from this process the pages read so far (`madvise(MADV_DONTNEED)`; Linux): the
        kernel keeps them in its page cache and maps them back on the next read, but they stop
        counting as this process's memory (the whole 1.1 GB of the default target's file by the
        end of its first quantization)."""
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        for m in self.maps:  # each map starts on a page: np.memmap at offset 0
            if len(m):
                libc.madvise(ctypes.c_void_p(m.ctypes.data), ctypes.c_size_t(len(m)), _MADV_DONTNEED)

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) as uint8 (read-only view, or a copy across a part boundary)."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop, side="left")) - 1
        if first == last:
            base = int(self.starts[first])
            return self.maps[first][start - base : stop - base]
        return np.concatenate([m[max(start - int(b), 0) : max(stop - int(b), 0)]
                               for m, b in zip(self.maps[first : last + 1], self.starts[first : last + 1])])


@dataclass(frozen=True)
class GGUFFile:
    """The metadata (string arrays as their length), tensor table and mapped bytes of a GGUF file."""

    path: Path  # the file, or its first part
    metadata: dict
    tensors: dict[str, GGUFTensor]
    data: MappedBytes
    metadata_end: int  # where the tensor table starts (the header up to here is all metadata)

    @classmethod
    def open(cls, path: str | Path | Sequence[str | Path]) -> "GGUFFile":
        """Map a GGUF file, or its parts in order (a list of paths)."""
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        data = MappedBytes(paths)
        head = data.maps[0]
        for grow in range(1, len(data.maps) + 1):  # a header longer than the first part: join more
            try:
                return cls._parse(Path(paths[0]), data, head)
            except (struct.error, IndexError, UnicodeDecodeError) as error:
                if grow == len(data.maps):
                    raise ValueError(f"{paths[0]}: its GGUF header is cut short or corrupt ({len(data)} bytes; "
                                     f"{error}): the file is truncated or damaged (an interrupted download?)") from None
                head = data.slice(0, int(data.starts[grow + 1]))
        raise AssertionError("unreachable")

    @classmethod
    def _parse(cls, path: Path, data: MappedBytes, head: np.ndarray) -> "GGUFFile":
        if bytes(head[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in _VERSIONS:
            raise ValueError(f"{path} is GGUF v{version}; specdec reads v2 and v3")
        pos, metadata = 24, {}
        for _ in range(num_kv):
            key, pos = _string(head, pos)
            (kind,) = struct.unpack_from("<I", head, pos)
            metadata[key], pos = _value(head, pos + 4, kind)
        metadata_end, table = pos, []
        for _ in range(num_tensors):
            name, pos = _string(head, pos)
            (ndim,) = struct.unpack_from("<I", head, pos)
            dims = struct.unpack_from(f"<{ndim}Q", head, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", head, pos + 4 + 8 * ndim)
            pos += 16 + 8 * ndim
            table.append((name, tuple(reversed(dims)), ggml_type, offset))  # ggml lists dims innermost first
        if pos > len(head):
            raise IndexError("the header runs past the bytes read")
        align = metadata.get("general.alignment", 32)
        base = (pos + align - 1) // align * align
        tensors = {
            name: GGUFTensor(name, shape, t, base + offset, _nbytes(t, prod(shape), name))
            for name, shape, t, offset in table
        }
        if tensors and (last := max(tensors.values(), key=lambda t: t.start + t.nbytes)).start + last.nbytes > len(data):
            raise ValueError(f"{path} is truncated: its tensors take {last.start + last.nbytes} bytes, the file holds "
                             f"{len(data)} ({last.name} ends past its end; an interrupted download?)")
        for info in tensors.values():
            if not readable(info.ggml_type):
                import gguf

                raise ValueError(f"{path}: tensor {info.name} is stored as {gguf.GGMLQuantizationType(info.ggml_type).name}, "
                                 "a ggml type specdec has no reader for (docs/gguf-kernels.md lists those read)")
        return cls(path, metadata, tensors, data, metadata_end)

    def write_metadata_only(self, out: str | Path, architecture: str | None = None) -> None:
        """Write a GGUF file holding this file's metadata and no tensors (a few MB: what
        transformers reads a tokenizer from, where the file itself is in parts); with
        `architecture`, its `general.architecture` value replaced by that one (transformers reads
        tokenizers only of the architectures it loads; the tokenizer keys do not depend on it)."""
        header = bytearray(self.data.slice(0, self.metadata_end))
        struct.pack_into("<Q", header, 8, 0)  # tensor count
        if architecture is not None:
            old = self.metadata["general.architecture"].encode()
            key = _gguf_string(b"general.architecture") + struct.pack("<I", 8)  # 8: GGUF's string type
            at = header.index(key + _gguf_string(old)) + len(key)
            header[at : at + len(_gguf_string(old))] = _gguf_string(architecture.encode())
        Path(out).write_bytes(bytes(header))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` as the gguf package lays them out: `[rows, row bytes]`
        uint8 for blocks, the values themselves for F32 / F16 (a view of the mapped file)."""
        info = self.tensors[name]
        flat = self.data.slice(info.start, info.start + info.nbytes)
        import gguf

        kind = gguf.GGMLQuantizationType(info.ggml_type)
        if kind == gguf.GGMLQuantizationType.F32:
            return flat.view(np.float32).reshape(info.shape)
        if kind == gguf.GGMLQuantizationType.F16:
            return flat.view(np.float16).reshape(info.shape)
        return flat.reshape(*info.shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 `info.shape` (F16 / F32 as stored, blocks dequantized: the
        gguf package's values, computed by `gguf_dequant` on every core)."""
        from specdec.target.gguf_dequant import dequantize

        info = self.tensors[name]
        return dequantize(self.raw(name), info.ggml_type).reshape(info.shape).numpy()


    def dequantize_slice(self, name: str, index: int) -> np.ndarray:
        """`tensor[index]` of a stacked tensor (an MoE layer's experts `[E, out, in]`) as float32
        `shape[1:]`, dequantizing only its blocks."""
        from specdec.target.gguf_dequant import dequantize

        info = self.tensors[name]
        if not 0 <= index < info.shape[0]:
            raise IndexError(f"{name} has {info.shape[0]} slices, not {index + 1}")
        return dequantize(self.raw(name)[index], info.ggml_type).reshape(info.shape[1:]).numpy()


def _string(data: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, pos)
    return bytes(data[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _value(data: np.ndarray, pos: int, kind: int):
    """One metadata value and the position after it; an array of strings reads as its length."""
    if kind in _SCALAR:
        (value,) = struct.unpack_from(_SCALAR[kind], data, pos)
        return value, pos + struct.calcsize(_SCALAR[kind])
    if kind == _STRING:
        return _string(data, pos)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF metadata type {kind}")
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item in _SCALAR:
        fmt = _SCALAR[item]
        return list(struct.unpack_from(f"<{count}{fmt[1]}", data, pos)), pos + count * struct.calcsize(fmt)
    if item != _STRING:
        raise ValueError(f"GGUF arrays of type {item} are not supported")
    for _ in range(count):  # a vocabulary or merge table: walked, not decoded
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + length
    return count, pos


@functools.cache
def readable(ggml_type: int) -> bool:
    """Whether specdec can read tensors of `ggml_type` (its own dequantizers, or the gguf
    package's): one zero block is dequantized to find out."""
    import gguf

    kind = gguf.GGMLQuantizationType(ggml_type)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8) if kind != gguf.GGMLQuantizationType.F32
                               else np.zeros(1, np.float32), kind)
    except NotImplementedError:
        return False
    return True


def _nbytes(ggml_type: int, elements: int, name: str) -> int:
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has ggml type {ggml_type}, unknown to the gguf package") from None
    return elements // block * size


def _gguf_string(b: bytes) -> bytes:
    """A GGUF string as stored: its byte length (u64) then the bytes."""
    return struct.pack("<Q", len(b)) + b
