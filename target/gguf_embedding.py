"""An embedding table left in its GGUF file: rows are dequantized when looked up.

A lookup reads one row per token, so the table need not be in a kernel's format, nor in memory,
nor in the quantized cache: the quantized models of the default pair stored theirs in bf16 (467 MB
for the 1.5B target, 272 MB for the 0.5B draft) where the GGUF holds it in 131 MB / 94 MB of
blocks. `GGUFEmbedding` maps the table where it lies (a view of the file's pages, or of the
default pair's package chunks) and dequantizes the rows of each forward's tokens exactly as the
full-tensor conversion did (float32 from the blocks, then the model dtype): the values are
bitwise those of the bf16 table it replaces. Rows of the types `kquant.KIND_NAMES` lists are read by C
(`kquant_pack.c` `gguf_rows`: ~5 us a row where the torch ops take ~270 us a lookup), the other
types by `gguf_dequant`.

    >>> emb = GGUFEmbedding(gguf_file, "token_embd.weight", torch.bfloat16)   # doctest: +SKIP
    >>> emb(torch.tensor([17, 42])).shape
    torch.Size([2, 1536])
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdec.kernel_abi import raise_for_status
from specdec.target.gguf_dequant import dequantize
from specdec.target.gguf_file import GGUFFile
from specdec.target.quant import kquant


class GGUFEmbedding(nn.Module):
    """`nn.Embedding`'s forward over the rows of GGUF tensor `name` (no parameters: a cache file
    records only the tensor's name, `cache_file`)."""

    def __init__(self, gguf: GGUFFile, name: str, dtype: torch.dtype) -> None:
        super().__init__()
        info = gguf.tensors[name]
        self.gguf_name, self.ggml_type, self.dtype = name, info.ggml_type, dtype
        self.num_embeddings, self.embedding_dim = info.shape
        self._rows = np.asarray(gguf.raw(name)).reshape(self.num_embeddings, -1)  # [V, row bytes] (or values)
        kind = kquant.GGML_KINDS.get(self.ggml_type)  # rows the C lookup reads (`_c_kind`), else None
        fits = (kind is not None and kind not in kquant.FLOAT_KINDS and self.embedding_dim % kquant.BLOCK_INPUTS[kind] == 0
                and self._rows.dtype == np.uint8 and self._rows.strides[1] == 1)
        self._c_kind = kind if fits else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [*] int -> [*, D] dtype
        flat = ids.reshape(-1).cpu().to(torch.int64).contiguous()
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {int(flat.min())}..{int(flat.max())}")
        if not flat.numel():  # (gguf's dequantize of zero IQ4_NL rows raises)
            return torch.empty(*ids.shape, self.embedding_dim, dtype=self.dtype)
        lib = kquant.PACKER.load() if self._c_kind is not None and self.dtype in (torch.bfloat16, torch.float32) else None
        if lib is not None and flat.numel():
            out = torch.empty(flat.numel(), self.embedding_dim, dtype=self.dtype)
            rc = lib.gguf_rows(self._rows.ctypes.data, self._rows.strides[0], self.num_embeddings, flat.data_ptr(),
                               flat.numel(), self.embedding_dim, self._c_kind, out.data_ptr(), self.dtype == torch.bfloat16)
            raise_for_status(rc, "gguf_rows")
            return out.reshape(*ids.shape, self.embedding_dim)
        rows = self._rows[flat.numpy()]  # [T, row bytes]: copies T rows only
        return dequantize(rows, self.ggml_type).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, gguf={self.gguf_name}, dtype={self.dtype}"


def plain_rows(processor, gguf: GGUFFile, name: str) -> bool:
    """Whether transformers' tensor processor leaves GGUF tensor `name` as stored (then its rows can
    be read as they lie); checked on its first rows, since processors work tensor by tensor."""
    probe = dequantize(np.asarray(gguf.raw(name))[:2], gguf.tensors[name].ggml_type).numpy()  # [2, D]
    try:
        processed = processor.process(weights=probe.copy(), name=name).weights
    except Exception:  # a processor that needs the whole tensor: read it the usual way
        return False
    return processed.shape == probe.shape and np.array_equal(processed, probe)
