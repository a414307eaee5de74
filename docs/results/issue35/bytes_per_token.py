"""Weight bytes one decoded token reads: specdec's tiles against the GGUF's own blocks, on an MoE GGUF.

A token reads every layer's attention, its top-k experts' share of each stacked expert tensor
(k / E of it, whatever experts it picks: they are all the same size), the norms and router (small;
counted on both sides as stored) and the LM head. Usage:
    python docs/results/issue35/bytes_per_token.py MODEL.gguf
"""
import sys

import torch

from specdec.target.gguf_file import GGUFFile
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.moe import SparseMoE
from specdec.target.quant.qlinear import QLinear

path = sys.argv[1]
gguf = GGUFFile.open(path)
meta = gguf.metadata
arch = meta["general.architecture"]
experts, top_k = meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]
theirs = {"head": 0, "attention": 0, "experts": 0}
for name, t in gguf.tensors.items():
    if name == "output.weight":
        theirs["head"] += t.nbytes
    elif "_exps." in name:
        theirs["experts"] += t.nbytes * top_k // experts
    elif name.startswith("blk.") and ("attn_" in name):
        theirs["attention"] += t.nbytes

model = load_model(resolve_model(path, progress=False), torch.bfloat16, "cpu", "w4a8-auto")
tiles = lambda m: sum(q.tiles.numel() for q in m.modules() if isinstance(q, QLinear))  # noqa: E731
ours = {"head": tiles(model.lm_head), "attention": 0, "experts": 0}
for layer in model.model.layers:
    ours["attention"] += tiles(layer.self_attn)
    if isinstance(layer.mlp, SparseMoE):
        ours["experts"] += tiles(layer.mlp.experts) * top_k // experts
print(f"{gguf.path.name}: weight bytes one token reads (MB), specdec's tiles vs the GGUF's blocks\n")
print("| | specdec | GGUF (llama.cpp) | ratio |\n|---|---|---|---|")
for key in (*ours, "total"):
    a = sum(ours.values()) if key == "total" else ours[key]
    b = sum(theirs.values()) if key == "total" else theirs[key]
    print(f"| {key} | {a / 1e6:.1f} | {b / 1e6:.1f} | {a / b:.3f} |")
