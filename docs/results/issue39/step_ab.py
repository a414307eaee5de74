"""Decode speed of one process against TP=2 split exactly and TP=2 by partial sums (and PP=2),
all engines loaded at once and run in turn, prompt by prompt, so that the host's drift falls on
all of them alike: the median over rounds of each engine's tok/s (64 greedy tokens, target-only
unless --speculative), and the ratios to one process.

    python docs/results/issue39/step_ab.py [ROUNDS] [--speculative]
"""

import itertools
import json
import statistics
import sys
import time

from specdec import Engine, EngineConfig, SamplingParams
from specdec.eval.datasets import humaneval_prompts

LAYOUTS = {"one process": {}, "TP=2 exact": {"tensor_parallel_size": 2},
           "TP=2 partial sums": {"tensor_parallel_size": 2, "tensor_parallel_exact": False},
           "PP=2": {"pipeline_parallel_size": 2}}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 6
    speculative = "--speculative" in sys.argv
    prompts = [p.text for p in itertools.islice(humaneval_prompts(), rounds)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engines = {name: Engine(EngineConfig(proposer="hybrid" if speculative else "none", **layout))
               for name, layout in LAYOUTS.items()}
    for e in engines.values():
        e.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    speeds = {name: [] for name in engines}
    tokens = {name: [] for name in engines}
    for r, prompt in enumerate(prompts):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            t = time.perf_counter()
            out = engines[name].generate([prompt], params)[0]
            speeds[name].append(64 / (time.perf_counter() - t))
            tokens[name].append(out.token_ids)
    one = statistics.median(speeds["one process"])
    result = {"mode": "speculative" if speculative else "target-only", "rounds": rounds}
    for name in engines:
        med = statistics.median(speeds[name])
        same = sum(a == b for a, b in zip(tokens[name], tokens["one process"]))
        result[name] = {"median_tok_s": round(med, 2), "vs_one": round(med / one, 3), "same_tokens": f"{same}/{rounds}",
                        "tok_s": [round(s, 2) for s in speeds[name]]}
        engines[name].close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
