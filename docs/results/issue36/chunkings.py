"""One 600-token prompt prefilled in different chunks (default target, bf16, 2 threads): whether
the logits of the decode row after it are bitwise those of one chunk. 0.20.1 (prompt chunks on
SDPA): every chunking differed, by up to 0.6 of a logit; 0.20.2 (the C attention): all equal.

    python docs/results/issue36/chunkings.py
"""

import torch

from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window

torch.set_num_threads(2)
runner = ModelRunner.build(load_model(resolve_model("default-target"), torch.bfloat16, "cpu", "gguf"), 16, None,
                           num_blocks=512)
N = 600
ids = [(i * 7919) % 150000 + 100 for i in range(N)]


def logits_after(chunks: list[int]) -> torch.Tensor:
    table, fed = runner.new_table(), 0
    for n in chunks:
        table.ensure_slots(fed + n)
        runner.forward([Window(table, ids[fed:fed + n], 1)])
        fed += n
    table.ensure_slots(N + 1)
    out = runner.forward([Window(table, ids[:1], 1)]).clone()
    table.free()
    return out


whole = logits_after([N])
for chunks in ([100, 250, 250], [40, 560], [20, 580], [300, 300], [599, 1], [64] * 9 + [24]):
    got = logits_after(chunks)
    print(chunks, "equal" if torch.equal(got, whole) else f"differs by up to {(got.float() - whole.float()).abs().max():.4f}")
