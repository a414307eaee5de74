"""`python -m specdec.eval.bench_int8_kernel`: `Int8Linear` on the AVX2 kernel (`int8_avx2.c`)
against fbgemm, side by side in one run, on the 1.5B target's shapes.

For each weight shape (N, K): the one-off cost of `prepack()` at load (fbgemm's `linear_prepack`
against the kernel's, which has nothing to pack), then the forward's median time for decode
(M = 1), verification (M = 6, 9) and prefill (M = 128, 512) rows on both paths, and whether the two
outputs are bitwise equal. Two threads, as the engine runs on this machine. Timings are as noisy as
the machine is busy: check `uptime` first. On a machine with AVX-512 VNNI, fbgemm multiplies with
VNNI and the kernel is not used: `FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python -m
specdec.eval.bench_int8_kernel` times what an AVX2 machine runs.

On a 2-core AVX-512 EPYC held to AVX2 (2026-12-01): prepack 0.05 ms against fbgemm's 13 ms to
2.5 s per matrix; 1 row 0.9-1.35x fbgemm's speed, 6-9 rows 0.47-1.13x, 128-512 rows 0.57-0.91x
(docs/results/session10.md).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from specdec.target.quant import int8_kernel
from specdec.target.quant.int8 import Int8Linear, fbgemm_uses_vnni

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]  # (N, K)
ROWS = [1, 6, 9, 128, 512]


def median_ms(fn: Callable[[], object], min_repeats: int = 5, budget_s: float = 1.0) -> float:
    """Median wall time of `fn` in ms over at least `min_repeats` calls (more while within
    `budget_s`), after one warm-up."""
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


def ready_modules(n: int, k: int) -> tuple[Int8Linear, Int8Linear, float, float]:
    """(kernel module, fbgemm module, kernel prepack ms, fbgemm prepack ms) on one random weight."""
    weight_int8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)  # [N, K]
    weight_scale = torch.rand(n) / 1000 + 1e-4  # [N]
    kernel, fbgemm = Int8Linear(weight_int8, weight_scale, None), Int8Linear(weight_int8, weight_scale, None)
    t = time.perf_counter()
    kernel.prepack()
    kernel_ms = 1e3 * (time.perf_counter() - t)
    os.environ["SPECDEC_NO_KERNELS"] = "1"  # this module only: the path is chosen at prepack
    try:
        t = time.perf_counter()
        fbgemm.prepack()
        fbgemm_ms = 1e3 * (time.perf_counter() - t)
    finally:
        del os.environ["SPECDEC_NO_KERNELS"]
    assert isinstance(kernel._packed, torch.Tensor) and not isinstance(fbgemm._packed, torch.Tensor)
    return kernel, fbgemm, kernel_ms, fbgemm_ms


def main() -> None:
    torch.set_num_threads(2)
    reason = int8_kernel.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the AVX2 int8 kernel cannot run here: {reason}")
    if fbgemm_uses_vnni():
        raise SystemExit("fbgemm multiplies with AVX-512 VNNI here, where Int8Linear keeps it: run with "
                         "FBGEMM_ENABLE_INSTRUCTIONS=AVX2 to time what an AVX2 machine runs")
    os.environ["SPECDEC_INT8_KERNEL"] = "1"  # opt-in (see int8.uses_int8_kernel)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'N x K':>14} {'M':>4} {'kernel ms':>10} {'fbgemm ms':>10} {'fbgemm/kernel':>14} equal")
    for n, k in SHAPES:
        kernel, fbgemm, kernel_ms, fbgemm_ms = ready_modules(n, k)
        print(f"{n:>7} x {k:<5} prepack: kernel {kernel_ms:.3f} ms, fbgemm {fbgemm_ms:.1f} ms")
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16)  # [M, K]
            equal = torch.equal(kernel(x), fbgemm(x))
            ours, theirs = median_ms(partial(kernel, x)), median_ms(partial(fbgemm, x))
            print(f"{n:>7} x {k:<5}{m:>4} {ours:>10.3f} {theirs:>10.3f} {theirs / ours:>14.2f} {equal}")


if __name__ == "__main__":
    main()
