import hashlib, json, sys
from specdec import Engine, EngineConfig, SamplingParams
prompts = ["def quicksort(xs):\n", "Write a haiku about rust.", "def fizzbuzz(n):\n    \"\"\"Print fizzbuzz up to n.\"\"\"\n"]
out = {}
for name, cfg in {"target-only": dict(proposer="none"), "spec-fixed-k4": dict(adaptive_k=False, num_speculative_tokens=4)}.items():
    e = Engine(EngineConfig(**cfg))
    res = e.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    out[name] = [r.token_ids for r in res]
    del e
print(json.dumps({k: hashlib.sha1(json.dumps(v).encode()).hexdigest()[:12] for k, v in out.items()}),
      "spec==target:", [a == b for a, b in zip(out["target-only"], out["spec-fixed-k4"])])
