"""An embedding table left in its GGUF file: rows are dequantized when looked up.

A lookup reads one row per token, so the table need not be in a kernel's format, nor in memory,
nor in the quantized cache: the quantized models of the default pair stored theirs in bf16 (467 MB
for the 1.5B target, 272 MB for the 0.5B draft) where the GGUF holds it in 131 MB / 94 MB of
blocks. `GGUFEmbedding` maps the table where it lies (a view of the file's pages, or of the
default pair's package chunks) and dequantizes the rows of each forward's tokens exactly as the
full-tensor conversion did (float32 from the blocks, then the model dtype): the values are
bitwise those of the bf16 table it replaces.

    >>> emb = GGUFEmbedding(gguf_file, "token_embd.weight", torch.bfloat16)   # doctest: +SKIP
    >>> emb(torch.tensor([17, 42])).shape
    torch.Size([2, 1536])
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdec.target.gguf_dequant import dequantize
from specdec.target.gguf_file import GGUFFile


class GGUFEmbedding(nn.Module):
    """`nn.Embedding`'s forward over the rows of GGUF tensor `name` (no parameters: a cache file
    records only the tensor's name, `cache_file`)."""

    def __init__(self, gguf: GGUFFile, name: str, dtype: torch.dtype) -> None:
        super().__init__()
        info = gguf.tensors[name]
        self.gguf_name, self.ggml_type, self.dtype = name, info.ggml_type, dtype
        self.num_embeddings, self.embedding_dim = info.shape
        self._rows = np.asarray(gguf.raw(name)).reshape(self.num_embeddings, -1)  # [V, row bytes] (or values)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [*] int -> [*, D] dtype
        rows = self._rows[ids.reshape(-1).cpu().numpy()]  # [T, row bytes]: copies T rows only
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
