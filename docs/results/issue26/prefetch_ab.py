"""qgemm before and after a change, in one process, call by call alternating (this machine's speed
drifts by a third within the hour, so only interleaved timings compare): the old `qgemm.c` and
`qgemm_tiles.h` from git revision REV built beside the checkout's, both bound in turn to the same
random `QLinear`s, weights streamed from memory (8 gate|up or 4 down matrices: more than the L3
holds; the int8 LM head alone is 248 MB). Median ms of a call.
Usage: python docs/results/issue26/prefetch_ab.py LEVEL [REV]   (REV: 997ab6b, before the prefetch)
Env: CASE (substring of the case names), ROWS ("1 4 6"), REPS (12)."""
import os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

level, rev = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "997ab6b"
os.environ["SPECDEC_ISA"] = level
import torch  # noqa: E402

torch.set_num_threads(2)
from specdec import native  # noqa: E402
from specdec.eval.bench_qgemm import random_linear  # noqa: E402
from specdec.target.quant import qgemm  # noqa: E402

old_dir = Path(tempfile.mkdtemp())
for name in ("qgemm.c", "qgemm_tiles.h"):
    text = subprocess.run(["git", "show", f"{rev}:target/quant/{name}"], capture_output=True, text=True, check=True).stdout
    (old_dir / name).write_text(text)
lv = native.level_named(level)
old_kernel = native.NativeKernel((old_dir / "qgemm.c",), lv.flags, lv.cpu_flags, ("qgemm",), (old_dir / "qgemm_tiles.h",), level)
libs = {"old": native.open_library(old_kernel.build(), ("qgemm",)), "new": qgemm.require_qgemm()}
cases = {"gate_up int4 x8": lambda: [random_linear(17920, 1536, True) for _ in range(8)],
         "down int4 x4": lambda: [random_linear(1536, 8960, True) for _ in range(4)],
         "lm_head int8": lambda: [random_linear(151936, 1536, False)]}
for name, make in cases.items():
    if os.environ.get("CASE", "") not in name:
        continue
    lins = make()
    for rows in [int(r) for r in os.environ.get("ROWS", "1 4 6").split()]:
        x = torch.randn(rows, lins[0].in_features, dtype=torch.bfloat16)
        times = {"old": [], "new": []}
        for rep in range(int(os.environ.get("REPS", "12"))):
            for which in ("old", "new") if rep % 2 else ("new", "old"):
                for lin in lins:
                    lin._lib = libs[which]
                t0 = time.perf_counter()
                for lin in lins:
                    lin(x)
                times[which].append((time.perf_counter() - t0) / len(lins))
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{level} {name:16s} rows {rows}: old {1e3 * o:.3f} ms, new {1e3 * n:.3f} ms, new/old {n / o:.3f}", flush=True)
