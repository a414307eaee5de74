"""How much a fixed decode step varies on this machine with nothing else running: the default
target's 2-row forward (two sequences of CONTEXT cached tokens, each step truncated back), one
thread, 300 times; p50 / p90 / p99 and p99 / p50, plus the page faults and context switches of
the timed loop. The floor under any served stream's ITL p99 / p50.

    python docs/results/issue36/noise.py 400
"""

import resource
import statistics
import sys
import time

import torch

from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window

torch.set_num_threads(1)
runner = ModelRunner.build(load_model(resolve_model("default-target"), torch.bfloat16, "cpu", "gguf"), 16, None,
                           num_blocks=256)
context = int(sys.argv[1]) if len(sys.argv) > 1 else 400
ids = [(i * 7919) % 150000 + 100 for i in range(context)]
tables = []
for _ in range(2):
    table = runner.new_table()
    table.ensure_slots(context)
    runner.forward([Window(table, ids, 1)])
    tables.append(table)
before, times = resource.getrusage(resource.RUSAGE_SELF), []
for _ in range(300):
    for table in tables:
        table.ensure_slots(context + 1)
    started = time.perf_counter()
    runner.forward([Window(table, ids[:1], 1) for table in tables])
    times.append(time.perf_counter() - started)
    for table in tables:
        table.truncate(context)
after = resource.getrusage(resource.RUSAGE_SELF)
v = sorted(times[5:])
p50, p90, p99 = statistics.median(v), v[int(0.9 * len(v))], v[int(0.99 * len(v))]
print(f"context {context}: p50 {1e3 * p50:.1f} ms, p90 {1e3 * p90:.1f}, p99 {1e3 * p99:.1f}, max {1e3 * v[-1]:.1f}; "
      f"p99 / p50 {p99 / p50:.2f}x; page faults {after.ru_minflt - before.ru_minflt}, "
      f"context switches {after.ru_nvcsw - before.ru_nvcsw} + {after.ru_nivcsw - before.ru_nivcsw} involuntary")
