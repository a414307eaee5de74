"""A ceiling for speculative decoding with this draft that assumes no acceptance model: an oracle
that drafts exactly the tokens the draft model gets right, and nothing where it gets the first one
wrong, with every forward at the machine's floor (`specdec.eval.roofline`: memory or int8 peak,
whichever binds). The default pair's greedy answers to the first N prompts of a dataset (128
tokens); the draft (as the engine loads it: the GGUF read as stored, its cut head) teacher-forced
over prompt + answer gives, per answer token, whether its greedy guess is the target's. A step
from token i drafts the m tokens of the agreeing run from i (at most --cap), costs m one-row draft
forwards plus a target forward of m + 1 rows, and emits m + 1 tokens; both models' prompts and the
first token as in the roofline. No chain proposer of this draft, however it picks its lengths,
emits more per step; prompt lookup is left out (it proposes what the draft cannot). Prints, per
level, target-only and oracle tok/s and their ratio, and the oracle against llama.cpp's tg128
ceiling. `python -m specdec.eval.roofline --oracle DATASET --max-k CAP` now prices the same (its
functions, used here). Usage: python oracle_ceiling.py humaneval|sharegpt [N] [cap]"""
import sys, torch
torch.set_num_threads(2)
from specdec import Engine, EngineConfig, native
from specdec.eval import roofline
from specdec.eval.runner import encode_prompts

ds = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 10; cap = int(sys.argv[3]) if len(sys.argv) > 3 else 16
levels = [lv.name for lv in native.machine_levels()]
machine = roofline.measure_machine(2, levels)
eng = Engine(EngineConfig())
prompts = [p.token_ids for p in encode_prompts(eng, ds, n, 0, 1024, 128)]
runs = roofline.draft_agreement(eng, prompts, 128)  # per prompt: (prompt length, the guesses' flags)
target_cost = roofline.model_cost(eng.target.model, "target")
draft_cost = roofline.model_cost(eng.proposer.runner.model, "draft")
agree = sum(sum(f) for _, f in runs) / sum(len(f) for _, f in runs)
print(f"{ds}: {n} prompts, {sum(len(f) + 1 for _, f in runs)} answer tokens; the draft's greedy guess agrees on {agree:.3f} "
      f"of them; read bandwidth {machine.read_bytes_per_s / 1e9:.1f} GB/s")
print("| level | target-only tok/s | oracle speculative tok/s | oracle / target-only | oracle / llama.cpp tg128 ceiling |\n|---|---|---|---|---|")
for level in levels:
    tokens = sum(len(f) + 1 for _, f in runs)
    plain = sum(roofline.request_s(target_cost, None, machine, level, roofline.Workload(ds, plen, 0.0), len(f) + 1, 0)
                for plen, f in runs)
    spec = sum(roofline.oracle_request_s(target_cost, draft_cost, machine, level, plen, f, cap) for plen, f in runs)
    llama = 1 / (target_cost.bytes_per_token / machine.read_bytes_per_s)
    print(f"| {level} | {tokens / plain:.1f} | {tokens / spec:.1f} | {plain / spec:.2f}x | {tokens / spec / llama:.2f}x |")
