"""The decode attention kernel before and after a change: bitwise the same outputs, and the time
of one layer's call, side by side in one run.

    python docs/results/issue36/attention_ab.py [THREADS] [OLD_COMMIT]   # from the repository root

OLD_COMMIT ea28cda (the default): before a KV head was read once for all its query heads
(0.14.1); 8458b51: before the group's heads became the innermost loop and rows were prefetched
(0.20.1). The old kernel is `cache/paged_attention.c` at that commit (read with `git show`); both are
built for the AVX2 level. Cases: the unit tests' `build_case` (garbage in unused slots,
interleaved blocks) for the bitwise check; Qwen2.5-1.5B's heads (12 query / 2 KV heads of 128),
2 sequences at 200 and 1,500 tokens of context, 1 and 4 rows each, for the times (best of 3
rounds of 50 calls, alternating old and new).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import tests.cache.test_paged_attention as cases  # noqa: E402
from specdec.cache import cpu_attention  # noqa: E402
from tests.cache.test_cpu_attention import _window_rows  # noqa: E402

OLD_COMMIT = sys.argv[2] if len(sys.argv) > 2 else "ea28cda"


def libraries() -> dict:
    old = Path(tempfile.mkdtemp()) / "paged_attention.c"
    old.write_text(subprocess.run(["git", "show", f"{OLD_COMMIT}:cache/paged_attention.c"], check=True,
                                  capture_output=True, text=True).stdout)
    new = cpu_attention.SOURCE  # (the build puts specdec/ on the include path for both)
    libs = {}
    for name, source in (("old", old), ("new", new)):
        cpu_attention.SOURCE = source
        libs[name] = cpu_attention.kernel("avx2").load()
    cpu_attention.SOURCE = new
    return libs


def call(lib, query, cache, meta, per_seq, head_dim: int) -> torch.Tensor:
    meta.scratch["cpu_attention_lib"] = lib
    k, v = cache.layer(0)
    return cpu_attention.rope_write_attend(_window_rows(per_seq, meta), query.shape[1], k.shape[2], None, None, None,
                                           k, v, meta, head_dim**-0.5)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    libs = libraries()
    same = 0
    for block_size in (1, 16):
        for group in (1, 2, 6, 7, 16):
            for windows in ([(50, 1), (150, 5), (29, 9), (16, 16)], [(300, 1), (1500, 4)]):
                for n in (1, 2, 3, 8):
                    torch.set_num_threads(n)
                    outs = [call(lib, *cases.build_case(block_size, group, torch.bfloat16, windows=windows), cases.HEAD_DIM)
                            for lib in libs.values()]
                    assert torch.equal(outs[0], outs[1]), (block_size, group, windows, n)
                    same += 1
    print(f"bitwise equal in {same} of {same} cases (block 1 / 16, group 1-16, 1-8 threads)")
    torch.set_num_threads(threads)
    cases.HEAD_DIM = 128
    for context in (200, 1500):
        for rows in (1, 4):
            case = cases.build_case(16, 6, torch.bfloat16, windows=[(context, rows), (context, rows)])
            best = {}
            for _ in range(3):
                for name, lib in libs.items():
                    start = time.perf_counter()
                    for _ in range(50):
                        call(lib, *case, 128)
                    best[name] = min(best.get(name, 1e9), (time.perf_counter() - start) / 50 * 1000)
            print(f"context {context}, {rows} row(s) x 2 sequences, 12 / 2 heads of 128, {threads} thread(s): "
                  f"old {best['old']:.3f} ms, new {best['new']:.3f} ms ({best['old'] / best['new']:.2f}x)")


if __name__ == "__main__":
    main()
