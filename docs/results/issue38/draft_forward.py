"""The default draft's forward of the given row counts after 300 cached tokens (head cut to 32,768 ids,
2 threads), median ms of 15. Usage: python draft_forward.py gguf|w4a8 LABEL ROWS..."""
import sys, time, statistics, torch
torch.set_num_threads(2)
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window
from specdec.draft.vocab import restrict_head
mode = sys.argv[1]; label = sys.argv[2]; rows_list = [int(x) for x in sys.argv[3:]]
m = load_model(resolve_model("default-draft"), torch.bfloat16, "cpu", mode)
restrict_head(m, torch.arange(32768))
r = ModelRunner.build(m, 16, None, num_blocks=64)
ids = [(i * 7919) % 150000 + 100 for i in range(300)]
t = r.new_table(); t.ensure_slots(300); r.forward([Window(t, ids, 1)])
out = []
for rows in rows_list:
    ts = []
    for _ in range(15):
        t.ensure_slots(300 + rows); t0 = time.perf_counter(); r.forward([Window(t, ids[:rows], rows)]); ts.append(time.perf_counter() - t0); t.truncate(300)
    out.append(f"{rows}:{statistics.median(ts)*1e3:.2f}")
print(label, " ".join(out), flush=True)
