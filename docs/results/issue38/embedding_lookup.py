"""One-token embedding lookups of GGUF tables: the C row reader (`kquant_pack.c` `gguf_rows`) against
the torch dequantization it replaced, same rows, bitwise equal (checked on 2,100 random ids first).
Usage: python docs/results/issue38/embedding_lookup.py FILE.gguf ..."""
import sys
import time

import torch

from specdec.target.gguf_dequant import dequantize
from specdec.target.gguf_embedding import GGUFEmbedding
from specdec.target.gguf_file import GGUFFile

torch.set_num_threads(2)
print("| file | type | torch us a lookup | C us a lookup |\n|---|---|---|---|")
for path in sys.argv[1:]:
    emb = GGUFEmbedding(GGUFFile.open(path), "token_embd.weight", torch.bfloat16)
    ids = torch.randint(0, emb.num_embeddings, (3, 700))
    expected = dequantize(emb._rows[ids.reshape(-1).numpy()], emb.ggml_type).to(torch.bfloat16).reshape(3, 700, -1)
    assert emb._c_kind is not None and torch.equal(emb(ids), expected)
    times = {}
    for name, kind in (("torch", None), ("C", emb._c_kind)):
        emb._c_kind = kind
        start = time.perf_counter()
        for i in range(300):
            emb(torch.tensor([1000 + i]))
        times[name] = 1e6 * (time.perf_counter() - start) / 300
    print(f"| {path.split('/')[-1]} | {emb.ggml_type} | {times['torch']:.0f} | {times['C']:.0f} |")
