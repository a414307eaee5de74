"""The engine loops' own step log (`SPECDEC_STEP_LOG=PREFIX specdec serve ...`: one
`PREFIX.<pid>.jsonl` a replica) beside the streams' gaps: per replica, the iterations' time split
into applying commands (new requests, imported KV), the step and handing out deltas, the garbage
collector's pauses, and the longest iterations with what they did.

    python docs/results/issue36/steps.py PREFIX [N]      (PREFIX.*.jsonl, or .jsonl.gz as kept here)
"""

from __future__ import annotations

import glob
import gzip
import json
import sys


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else 0.0


def main() -> None:
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    for path in sorted(glob.glob(sys.argv[1] + ".*.jsonl") + glob.glob(sys.argv[1] + ".*.jsonl.gz")):
        lines = [json.loads(line) for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path))]
        busy = [x for x in lines if x["tokens"]]
        if not busy:
            continue
        total = [x["apply_s"] + x["step_s"] + x["rest_s"] for x in busy]
        print(f"## {path}: {len(busy)} iterations that emitted tokens")
        for key in ("apply_s", "step_s", "rest_s"):
            values = [x[key] for x in busy]
            print(f"  {key:8s} p50 {1000 * pct(values, 50):7.1f} ms  p99 {1000 * pct(values, 99):7.1f}  max {1000 * max(values):7.1f}")
        print(f"  total    p50 {1000 * pct(total, 50):7.1f} ms  p99 {1000 * pct(total, 99):7.1f}  max {1000 * max(total):7.1f}")
        pauses = [s for x in lines for g, s in x["gc"] if g == 2]
        print(f"  gc: {sum(len(x['gc']) for x in lines)} collections, {len(pauses)} of generation 2 "
              f"(longest {1000 * max(pauses, default=0):.0f} ms)")
        t0 = lines[0]["t"]
        for x in sorted(busy, key=lambda x: -(x["apply_s"] + x["step_s"] + x["rest_s"]))[:top]:
            print(f"  at {x['t'] - t0:7.1f} s: apply {1000 * x['apply_s']:.0f} step {1000 * x['step_s']:.0f} "
                  f"rest {1000 * x['rest_s']:.0f} ms, rows {x['rows']}, tokens {x['tokens']}, "
                  f"draft {x.get('draft')}, verify {x.get('verify')}, gc {x['gc']}")


if __name__ == "__main__":
    main()
