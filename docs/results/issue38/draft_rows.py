"""The default draft's forward over 1-12 rows (300 cached tokens, cut head of 32,768 ids, 2 threads)
read as stored (mode gguf) against int4 (w4a8), alternated 7 times, median ms. Usage: python draft_rows.py"""
import time, statistics, torch
torch.set_num_threads(2)
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window
from specdec.draft.vocab import restrict_head
models = {}
for mode in ("gguf", "w4a8"):
    m = load_model(resolve_model("default-draft"), torch.bfloat16, "cpu", mode)
    restrict_head(m, torch.arange(32768))
    models[mode] = ModelRunner.build(m, 16, None, num_blocks=64)
ids = [(i * 7919) % 150000 + 100 for i in range(300)]
tables = {}
for mode, r in models.items():
    t = r.new_table(); t.ensure_slots(300); r.forward([Window(t, ids, 1)]); tables[mode] = t
res = {}
for rows in (1, 2, 3, 4, 6, 12):
    out = {}
    for mode, r in models.items():
        out[mode] = []
    for rep in range(7):
        for mode, r in models.items():
            t = tables[mode]
            n = t.num_tokens if hasattr(t, "num_tokens") else 300
            t.ensure_slots(300 + rows)
            t0 = time.perf_counter()
            for _ in range(5):
                t.ensure_slots(300 + rows)
                r.forward([Window(t, ids[:rows], rows)])
                t.truncate(300)
            out[mode].append((time.perf_counter() - t0) / 5 * 1e3)
    print(rows, {m: round(statistics.median(v), 2) for m, v in out.items()}, flush=True)
