"""Per step kind (prompt lookup or the draft model, and its draft length), how many steps and how
many tokens each emitted: the default engine, the first N prompts of a dataset, greedy, 128 tokens.
Usage: python step_kinds.py humaneval|sharegpt N"""
import collections, sys, torch
torch.set_num_threads(2)
from specdec import Engine, EngineConfig, SamplingParams
from specdec.eval.runner import encode_prompts
from specdec.draft.hybrid import HybridProposer
ds = sys.argv[1]; n = int(sys.argv[2])
eng = Engine(EngineConfig())
prompts = [p.token_ids for p in encode_prompts(eng, ds, n, 0, 1024, 128)]
log = []
orig = HybridProposer.propose
def propose(self, plan, sampling):
    out = orig(self, plan, sampling)
    log.append((out.looked_up[0] if out.looked_up else None, out.num_draft[0] if out.num_draft else 0))
    return out
HybridProposer.propose = propose
ostep = eng.step
res = []
def step():
    d = ostep(); res.append(sum(len(x.token_ids) for x in d)); return d
eng.step = step
for p in prompts: eng.generate([p], SamplingParams(temperature=0, max_tokens=128))
# pair: each propose precedes a step's emission
stats = collections.defaultdict(lambda: collections.Counter())
for (lk, k), emitted in zip(log, res[-len(log):]):
    stats[("lookup" if lk else "model", k)][emitted] += 1
for key in sorted(stats, key=str):
    c = stats[key]; tot = sum(c.values()); print(key, tot, "mean emitted", round(sum(e*v for e,v in c.items())/tot,2), dict(sorted(c.items())))
