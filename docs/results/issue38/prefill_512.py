"""Target alone: one forward over a 512-token prompt (the default target, bf16, 2 threads) in the
given quantization mode, 3 times; tok/s of the best. Usage: python prefill_512.py gguf|w4a8-auto"""
import os, sys, time, torch
torch.set_num_threads(2)
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.runner import ModelRunner, Window
mode = sys.argv[1]
model = load_model(resolve_model("default-target"), torch.bfloat16, "cpu", mode)
runner = ModelRunner.build(model, 16, None, num_blocks=80)
ids = [(i * 7919) % 150000 + 100 for i in range(512)]
times = []
for rep in range(3):
    t = runner.new_table(); t.ensure_slots(512)
    t0 = time.perf_counter(); runner.forward([Window(t, ids, 1)]); times.append(time.perf_counter() - t0)
    t.truncate(0); runner.pool.free(t.block_ids) if t.block_ids else None
print(os.environ.get("SPECDEC_ISA", "best"), mode, "prefill 512:", [f"{x:.2f}" for x in times], f"{512/min(times):.1f} tok/s")
