"""Two streams of plain decoding on one thread, in-process, default pair: a step's time as the
streams' contexts grow (what spreads a long window's gaps without anything else running).

    python docs/results/issue36/growth.py
"""

import statistics
import time

import torch

from specdec import Engine, EngineConfig, SamplingParams

torch.set_num_threads(1)
engine = Engine(EngineConfig(proposer="none"))
params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
engine.add_request("def quicksort(xs):\n", params)
engine.add_request("def fibonacci(n):\n", params)
times = []
while engine.has_unfinished():
    started = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - started)
for lo in (0, 250, 500, 750, 1000, 1250, 1450):
    print(f"context ~{lo + 10}: step p50 {1000 * statistics.median(times[lo:lo + 50]):.0f} ms")
