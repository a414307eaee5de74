"""A prompt's prefill in one chunk with the attention on SDPA (`attention_backend="torch"`: what
prompt chunks got before 0.20.2, and the Python layers) against the C attention and the C layer
loop (`"auto"`), alternated 3 times, median seconds. Same weights, 2 threads.

    python docs/results/issue36/prefill_ab.py 512 1536 3000
    MODEL=default-draft python docs/results/issue36/prefill_ab.py 1000 3000
"""

import os
import statistics
import sys
import time

import torch

from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window

torch.set_num_threads(2)
model = load_model(resolve_model(os.environ.get("MODEL", "default-target")), torch.bfloat16, "cpu", "gguf")
runners = {backend: ModelRunner.build(model, 16, None, num_blocks=256, attention_backend=backend)
           for backend in ("torch", "auto")}
for n in [int(a) for a in sys.argv[1:]]:
    ids = [(i * 7919) % 150000 + 100 for i in range(n)]
    seconds: dict[str, list[float]] = {b: [] for b in runners}
    for _ in range(3):
        for backend, runner in runners.items():
            table = runner.new_table()
            table.ensure_slots(n)
            started = time.perf_counter()
            runner.forward([Window(table, ids, 1)])
            seconds[backend].append(time.perf_counter() - started)
            table.free()
    sdpa, c = (statistics.median(seconds[b]) for b in ("torch", "auto"))
    print(f"{n} tokens: SDPA {sdpa:.2f} s, C attention {c:.2f} s ({sdpa / c:.2f}x)", flush=True)
