"""The default target's forward of 1, 2, 4 and 6 rows after a 200-token prompt (the C layer loop, 2
threads), median ms of 12. Usage: python forward_rows.py LABEL. For an A/B, alternate it with the
kernel sources of two commits in target/quant/ (their library is rebuilt by hash, ~2 s)."""
import statistics, time, torch, sys
torch.set_num_threads(2)
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window
model = load_model(resolve_model("default-target"), torch.bfloat16, "cpu", "gguf")
runner = ModelRunner.build(model, 16, None, num_blocks=80)
ids = [(i * 7919) % 150000 + 100 for i in range(200)]
t = runner.new_table(); t.ensure_slots(264)
runner.forward([Window(t, ids, 1)])
out = []
for rows in (1, 2, 4, 6):
    ts = []
    for _ in range(12):
        t.ensure_slots(t.num_computed + rows)
        t0 = time.perf_counter(); runner.forward([Window(t, ids[:rows], rows)]); ts.append(time.perf_counter() - t0)
        t.truncate(200)
    out.append(f"{rows}:{statistics.median(ts)*1e3:.1f}")
print(sys.argv[1], " ".join(out), flush=True)
