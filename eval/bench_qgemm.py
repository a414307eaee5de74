"""`python -m specdec.eval.bench_qgemm`: the w4a8 GEMM (`qgemm.c`) at every instruction-set level this
machine runs, side by side in one run, on the 1.5B target's shapes.

For each weight shape (N, K) with the target's formats (int4 tiles, or int8 for the LM head) and
each row count (1 = decode, 2-9 = verifying k+1 tokens, 64-512 = prefill chunks): the median time
of one `QLinear` call at each level and its ratio to the first level, and whether every level's
output is bitwise the first level's. Two threads, as the engine runs on this machine. Timings
are as noisy as the machine is busy: run it with nothing else running (`uptime` first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from specdec import native
from specdec.target.quant.qlinear import QLinear

# (name, N, K, int4): the target's fused q|k|v, o, gate|up, down and its int8 LM head
SHAPES = [("qkv", 2048, 1536, True), ("o", 1536, 1536, True), ("gate_up", 17920, 1536, True),
          ("down", 1536, 8960, True), ("lm_head", 151936, 1536, False)]
ROWS = [1, 2, 4, 6, 9, 64, 512]


def median_ms(fn: Callable[[], object], min_repeats: int = 5, budget_s: float = 0.5) -> float:
    """Median wall time of `fn` in ms over at least `min_repeats` calls (more within `budget_s`),
    after one warm-up."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) >= 200:
            break
    return 1e3 * statistics.median(times)


def random_linear(n: int, k: int, int4: bool) -> QLinear:
    """A `QLinear` of random weights: on the int4 grid (every tile int4) or not (every tile int8)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    if int4:  # 16 levels per group of 32: quantize_int4 takes it exactly
        groups = w.view(n, k // 32, 32)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        step = (hi - lo) / 15
        w = (((groups - lo) / step).round() * step + lo).view(n, k)
    return QLinear.from_weight(w, None, int4_max_error=0.05 if int4 else 0.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [level.name for level in native.machine_levels()]
    if not levels:
        raise SystemExit(f"no level runs here: {native.describe_simd()}")
    print(f"levels: {', '.join(levels)}; {args.threads} threads; load {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>8} {'N x K':>13} {'M':>4} " + " ".join(f"{lv + ' ms':>15}" for lv in levels)
          + " " + " ".join(f"{lv + '/' + levels[0]:>22}" for lv in levels[1:]) + " equal")
    for name, n, k, int4 in (s for s in SHAPES if s[0] in args.shapes):
        modules = {}
        for level in levels:  # a QLinear binds the library of the level held when it is made
            os.environ[native.ISA_ENV] = level
            modules[level] = random_linear(n, k, int4)
        for m in args.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            ms = {lv: median_ms(lambda: modules[lv](x)) for lv in levels}
            outs = [modules[lv](x) for lv in levels]
            equal = all(torch.equal(outs[0], o) for o in outs[1:])
            print(f"{name:>8} {n:>6} x {k:<5} {m:>4} " + " ".join(f"{ms[lv]:>15.3f}" for lv in levels) + " "
                  + " ".join(f"{ms[lv] / ms[levels[0]]:>22.2f}" for lv in levels[1:]) + f" {equal}")
    os.environ.pop(native.ISA_ENV, None)


if __name__ == "__main__":
    main()
