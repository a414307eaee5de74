"""The default target (or draft) forward of 1, 2, 4, 6, 8 rows after a 200-token prefix: median of 15.
Usage: [SPECDEC_ISA=avx2] python docs/results/issue26/forward_rows.py target|draft"""
import os, sys, time, statistics, torch
torch.set_num_threads(2)
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window
DEFAULT_TARGET, DEFAULT_DRAFT = "default-target", "default-draft"
which = sys.argv[1]
d = resolve_model(DEFAULT_TARGET if which == "target" else DEFAULT_DRAFT)
model = load_model(d, torch.bfloat16, "cpu", "w4a8-auto" if which == "target" else "w4a8")
runner = ModelRunner.build(model, 16, None, num_blocks=200)
t = runner.new_table(); t.ensure_slots(1200)
ids = list(range(1000, 1300))
runner.forward([Window(t, ids[:200], 1)])
for rows in (1, 2, 4, 6, 8):
    times = []
    for rep in range(15):
        t.num_computed = 200
        t0 = time.perf_counter(); runner.forward([Window(t, ids[200:200+rows], rows)]); times.append(time.perf_counter() - t0)
    print(which, os.environ.get("SPECDEC_ISA", "best"), rows, f"{1e3*statistics.median(times):.1f} ms")
