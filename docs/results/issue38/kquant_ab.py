"""k-quant tiles against v0.15's re-quantized tiles on the same weights: one linear of the default
target's shapes (random valid Q4_K / Q6_K blocks), 2 threads, old and new alternated 7 times,
median ms. The matrices fit this machine's L3, so this is the compute-bound side (verify windows,
prefill); decode from memory is the end-to-end table's. Usage: python kquant_ab.py"""
import statistics, time
import numpy as np, torch
from specdec.target.quant.qlinear import QLinear, dequantize

torch.set_num_threads(2)


def k_blocks(kind, rows, cols, rng):
    b = rng.integers(0, 256, (rows, cols // 256, {12: 144, 14: 210}[kind]), dtype=np.uint8)
    scales = (10.0 ** rng.uniform(-4, -2, (rows, cols // 256, 2))).astype(np.float16).view(np.uint8)
    if kind == 12:
        b[..., 0:4] = scales.reshape(rows, cols // 256, 4)
    else:
        b[..., 208:210] = scales[..., :2]
    return b.reshape(rows, -1)


def once(f, reps):
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps * 1e3


rng = np.random.default_rng(0)
print("| tensor | rows | k-quant ms | v0.15 tiles ms | v0.15 / k-quant |\n|---|---|---|---|---|")
for kind, n, k, name in ((12, 17920, 1536, "Q4_K gate|up 17920x1536"), (14, 1536, 8960, "Q6_K down 1536x8960"),
                         (14, 37984, 1536, "Q6_K LM head, a quarter")):
    new = QLinear.from_gguf(k_blocks(kind, n, k, rng), kind, k, None)
    old = QLinear.from_weight(dequantize(new), None, int4_max_error=0.05 if kind == 12 else 0.0)
    for m in (1, 2, 4, 6, 8, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        reps = max(2, 60 // m)
        new(x), old(x)
        tn, to = [], []
        for _ in range(7):
            tn.append(once(lambda: new(x), reps)), to.append(once(lambda: old(x), reps))
        tn, to = statistics.median(tn), statistics.median(to)
        print(f"| {name} | {m} | {tn:.2f} | {to:.2f} | {to / tn:.2f} |", flush=True)
