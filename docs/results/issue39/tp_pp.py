"""Default pair, greedy, the first 10 HumanEval prompts, 128 new tokens (EOS ignored), as
`specdec bench latency` runs them: one process against TP=2 (split exactly, the default; and by
partial sums, `tensor_parallel_exact=False`) and PP=2, target-only and speculative,
rounds alternated; tokens compared prompt by prompt with the one-process run of the same mode.

    python docs/results/issue39/tp_pp.py OUT_DIR [ROUNDS]
"""

import itertools
import json
import sys
import time
from pathlib import Path

from specdec import Engine, EngineConfig, SamplingParams
from specdec.eval.datasets import humaneval_prompts

LAYOUTS = {"one process": {}, "TP=2": {"tensor_parallel_size": 2},
           "TP=2 partial sums": {"tensor_parallel_size": 2, "tensor_parallel_exact": False},
           "PP=2": {"pipeline_parallel_size": 2}}


def run(layout: dict, speculative: bool) -> dict:
    prompts = [p.text for p in itertools.islice(humaneval_prompts(), 10)]
    t0 = time.perf_counter()
    e = Engine(EngineConfig(proposer="hybrid" if speculative else "none", **layout))
    load = time.perf_counter() - t0
    e.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    group = getattr(e.target, "group", None)
    calls0 = (group.comm.num_all_reduces, group.comm.all_reduce_bytes) if group else (0, 0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    seconds, tokens = [], []
    for p in prompts:
        t = time.perf_counter()
        tokens.append(e.generate([p], params)[0].token_ids)
        seconds.append(time.perf_counter() - t)
    out = {"load_s": round(load, 1), "tok_s": round(128 * len(prompts) / sum(seconds), 2),
           "per_prompt_tok_s": [round(128 / s, 2) for s in seconds], "tokens": tokens,
           "driver_weights": e.target.memory_bytes()[0]}
    if group:
        n = 128 * len(prompts)
        out.update(ranks=group.rank_memory(), all_reduces_per_token=round((group.comm.num_all_reduces - calls0[0]) / n, 1),
                   all_reduce_bytes_per_token=round((group.comm.all_reduce_bytes - calls0[1]) / n))
    e.close()
    return out


def main() -> None:
    out_dir, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for r in range(rounds):
        for speculative in (False, True):
            for name, layout in LAYOUTS.items():
                res = run(layout, speculative)
                res.update(round=r, layout=name, mode="speculative" if speculative else "target-only")
                results.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "tokens"}), flush=True)
                (out_dir / "runs.json").write_text(json.dumps(results))
    for res in results:
        base = next(x for x in results if x["layout"] == "one process" and x["mode"] == res["mode"] and x["round"] == res["round"])
        res["same_tokens"] = [a == b for a, b in zip(res["tokens"], base["tokens"])]
        res["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                   for a, b in zip(res["tokens"], base["tokens"])]
    (out_dir / "runs.json").write_text(json.dumps(results))
    for res in results:
        print(res["round"], res["mode"], res["layout"], res["tok_s"], "same tokens",
              f"{sum(res['same_tokens'])}/10", "first differences", res["first_difference"])


if __name__ == "__main__":
    main()
