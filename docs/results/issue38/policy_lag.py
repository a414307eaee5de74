"""Each "whether to draft" decision of a lone sequence with a cap: k chosen, the acceptance estimate, the
lag priced (rows), the expected step ms and tok/s for k = 0..cap; then how many chose k = 0 at which
priced lag, and the cost tables (ms by power-of-two bucket of rows). Usage: python policy_lag.py DS N"""
import sys, torch
torch.set_num_threads(2)
from specdec import Engine, EngineConfig, SamplingParams, adaptive
from specdec.eval.runner import encode_prompts
ds, n = sys.argv[1], int(sys.argv[2])
orig = adaptive.SpeculationPolicy.best_k
rec = []
def best_k(self, rates, caps, lags=None, r=None):
    k = orig(self, rates, caps, lags, r)
    if caps and caps[0]:
        rec.append((k, rates[0], lags[0] if lags else 1, [round(1e3*self.step_seconds(kk, caps, lags), 1) for kk in range(caps[0]+1)],
                    [round(self.expected_rate(kk, rates, caps, lags), 1) for kk in range(caps[0]+1)]))
    return k
adaptive.SpeculationPolicy.best_k = best_k
eng = Engine(EngineConfig())
prompts = [p.token_ids for p in encode_prompts(eng, ds, n, 0, 1024, 128)]
for p in prompts: eng.generate([p], SamplingParams(temperature=0, max_tokens=128))
zs = [r for r in rec if r[0] == 0]
print(len(rec), "decisions,", len(zs), "k=0")
import collections
print("lags at k=0", collections.Counter(r[2] for r in zs))
for r in zs[:12] + zs[-5:]: print(r)
print("verify table", {b: round(1e3*s,1) for b, s in sorted(eng.policy.verify_cost.seconds.items())}, "draft", {b: round(1e3*s,1) for b, s in sorted(eng.policy.draft_cost.seconds.items())})
