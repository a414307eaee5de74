"""The draft vocabulary's sizes A/B, noise-robust: (1) the draft's one-row forward with each head,
alternated 60 times (median ms); (2) greedy speculative decoding of 10 HumanEval + 10 ShareGPT
prompts (64 tokens) per size: drafted and accepted tokens (deterministic), so the size's effect
is acceptance x draft cost, not one noisy tok/s. Usage: python vocab_ab.py [sizes...]"""
import statistics, sys, time
from specdec import Engine, EngineConfig, SamplingParams
from specdec.draft import vocab
from specdec.eval.runner import encode_prompts
from specdec.target.runner import Window

sizes = [int(s) if s.isdigit() else s for s in (sys.argv[1:] or ["full", "65536", "32768", "16384"])]
engine = Engine(EngineConfig(draft_vocab="full", kv_cache_memory_gib=0.5))
draft = engine.runners[1].model
full_head = draft.lm_head
stops = list(engine.eos_token_ids)
heads = {}
for s in sizes:
    if s == "full":
        heads[s] = (full_head, None)
    else:
        ids = vocab.frequent_ids(engine.tokenizer, s, stops, draft.config.vocab_size)
        vocab.restrict_head(draft, ids)
        heads[s] = (draft.lm_head, draft.head_ids)
        draft.lm_head, draft.head_ids = full_head, None

def use(s):
    draft.lm_head, draft.head_ids = heads[s]

runner = engine.runners[1]
times = {s: [] for s in sizes}
table = runner.new_table(); table.ensure_slots(64)
runner.forward([Window(table, list(range(100, 132)), 1)])
for rep in range(60):
    for s in sizes:
        use(s)
        table.ensure_slots(33)
        t0 = time.perf_counter(); runner.forward([Window(table, [200 + rep % 7], 1)]); times[s].append(time.perf_counter() - t0)
        table.truncate(32)
print("| draft head | one-row draft forward, median ms |")
print("|---|---|")
for s in sizes:
    print(f"| {s} | {1e3 * statistics.median(times[s]):.2f} |")

params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
prompts = {d: [p.token_ids for p in encode_prompts(engine, d, 10, 0, 1024, 64)] for d in ("humaneval", "sharegpt")}
print("\n| dataset | draft head | drafted | accepted | acceptance | tokens per target pass |")
print("|---|---|---|---|---|---|")
for d, ids in prompts.items():
    for s in sizes:
        use(s)
        drafted = accepted = passes = emitted = 0
        for p in ids:
            out = engine.generate([p], params)[0]
            st = out.stats
            drafted += st.num_draft_tokens; accepted += st.num_accepted_tokens
            passes += getattr(st, "num_drafts", 0)
            emitted += len(out.token_ids)
        per_pass = f"{emitted / passes:.2f}" if passes else "-"
        print(f"| {d} | {s} | {drafted} | {accepted} | {accepted / max(1, drafted):.3f} | {per_pass} |", flush=True)
