"""Peak anonymous memory (RssAnon, sampled every 20 ms) of each process of a split default
target while it loads, target-only: one process against TP=2 and PP=2 (local ranks). With
`LoadPart` (0.17.1) a rank reads its part only; before, every rank loaded the whole target and
then cut it. The mapped GGUF's pages (RssFile: page cache, shared, dropped under pressure) are
left out. Also the tokens of one prompt (32, greedy), to compare across checkouts.

    python docs/results/issue39/load_peak.py '{"tensor_parallel_size": 2}'   # from the checkout to measure
"""

import json
import os
import threading

from specdec import Engine, EngineConfig, SamplingParams


def anon_mb(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in open(f"/proc/{pid}/task/{tid}/children").read().split()]
        except OSError:
            pass
    return out


def measure(layout: dict) -> dict:
    peaks: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        me = os.getpid()
        while not done.wait(0.02):
            for pid in [me] + children(me):
                if (mb := anon_mb(pid)) is not None:
                    peaks[pid] = max(peaks.get(pid, 0), mb)

    threading.Thread(target=sample, daemon=True).start()
    e = Engine(EngineConfig(proposer="none", **layout))
    done.set()
    group = getattr(e.target, "group", None)
    ranks = [info["pid"] for info in group.rank_memory()] if group else []
    out = {"layout": layout or "one process", "driver_peak_anon_mb": round(peaks[os.getpid()]),
           "rank_peak_anon_mb": [round(peaks.get(pid, 0)) for pid in ranks]}
    out["tokens"] = e.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].token_ids
    e.close()
    return out


if __name__ == "__main__":
    import sys

    layout = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    print(json.dumps(measure(layout)), flush=True)
