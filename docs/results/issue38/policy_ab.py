"""The adaptive policy's "whether to draft" for a lone sequence, four ways: as shipped (`policy`:
its draft cache's lag priced up to `planner.MAX_PRICED_LAG` = 8 rows), with the lag priced as one row
(`nolag`: the catch-up as a sunk cost), and drafting whenever the cap allows (`always`: the draft's
early stop alone decides how far), or the shipped policy with a cap of 8 drafts instead of 5 (`cap8`).
The first N prompts of a dataset, one at a time, greedy, 128
tokens, after a 4-token warm-up. Usage: python policy_ab.py humaneval|sharegpt N policy|nolag|always|cap8"""
import sys, time, torch
torch.set_num_threads(2)
from specdec import Engine, EngineConfig, SamplingParams, adaptive, planner
from specdec.eval.runner import encode_prompts
ds, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "always":
    adaptive.SpeculationPolicy.best_k = lambda self, rates, caps, lags=None, ratio=None: max(caps, default=0)
elif mode == "nolag":
    planner.MAX_PRICED_LAG = 1
eng = Engine(EngineConfig(num_speculative_tokens=8) if mode == "cap8" else EngineConfig())
prompts = [p.token_ids for p in encode_prompts(eng, ds, n, 0, 1024, 128)]
eng.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))
t = time.perf_counter(); toks = 0
for p in prompts:
    toks += len(eng.generate([p], SamplingParams(temperature=0, max_tokens=128))[0].token_ids)
w = time.perf_counter() - t
print(f"{mode} {ds} {toks} tokens {w:.1f} s {toks/w:.2f} tok/s", flush=True)
