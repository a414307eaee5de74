"""Where a speculative step's time goes: the default pair on the first N prompts of a dataset, one at a
time, greedy, 128 tokens; the draft and verify forwards the adaptive policy times, by rows, and the
rest. Usage: python step_costs.py [N] [humaneval|sharegpt] [EngineConfig field=value ...]"""
import collections, statistics, sys, time
import torch
torch.set_num_threads(2)
from specdec import Engine, EngineConfig, SamplingParams
from specdec.eval.runner import encode_prompts
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
ds = sys.argv[2] if len(sys.argv) > 2 else "humaneval"
extra = dict(a.split("=") for a in sys.argv[3:])
for k, v in list(extra.items()):
    extra[k] = int(v) if v.isdigit() else (v == "True" if v in ("True", "False") else v)
eng = Engine(EngineConfig(**extra))
prompts = [p.token_ids for p in encode_prompts(eng, ds, n, 0, 1024, 128)]
draft = collections.defaultdict(list); verify = collections.defaultdict(list); steps = []
pol = eng.policy
orig = pol.observe
def observe(t):
    for r, s in t.draft: draft[r].append(s)
    for r, s in t.verify: verify[r].append(s)
    orig(t)
pol.observe = observe
ostep = eng.step
def step():
    t = time.perf_counter(); d = ostep(); steps.append((time.perf_counter() - t, sum(len(x.token_ids) for x in d)))
    return d
eng.step = step
t0 = time.perf_counter()
outs = [eng.generate([p], SamplingParams(temperature=0, max_tokens=128))[0] for p in prompts]
wall = time.perf_counter() - t0
toks = sum(len(o.token_ids) for o in outs)
print(f"{ds} {n} prompts: {toks} tokens in {wall:.1f} s = {toks/wall:.1f} tok/s; steps {len(steps)}")
dec = [(s, k) for s, k in steps if k > 0]
print(f"decode steps {len(dec)}: mean {1e3*statistics.mean(s for s,_ in dec):.1f} ms, tokens/step {statistics.mean(k for _,k in dec):.2f}")
print("draft forwards (rows: n, median ms):", {r: (len(v), round(1e3*statistics.median(v),1)) for r, v in sorted(draft.items())})
print("verify forwards (rows: n, median ms):", {r: (len(v), round(1e3*statistics.median(v),1)) for r, v in sorted(verify.items()) if len(v) > 2})
tot_d = sum(sum(v) for v in draft.values()); tot_v = sum(sum(v) for r, v in verify.items() if r <= 16); tot_s = sum(s for s, _ in dec)
print(f"decode-step time {tot_s:.1f} s: draft {tot_d:.1f} s, verify {tot_v:.1f} s, rest {tot_s - tot_d - tot_v:.1f} s")
st = [o.stats for o in outs]
print("acceptance", statistics.mean(s.acceptance_rate for s in st), "mean accepted len", statistics.mean(s.mean_accepted_length for s in st))
