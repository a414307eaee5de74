"""GGUF dequantization, gguf's numpy vs `specdec.target.gguf_dequant` (torch), on every tensor of the
default pair's GGUF files: total seconds per type both ways, the ratio, and a bitwise check.

    python docs/results/issue17/bench_dequant.py [--repeats 2] [--threads N] [--gguf-dir ~/.cache/specdec/gguf]

Each tensor is read once first (page faults off the clock), then dequantized both ways, alternating
which goes first, `--repeats` times; the best time of each counts, so a noisy machine (others'
tests) costs both sides alike. Exits 0 with a message when the files are absent.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch

from specdec.target.gguf_dequant import dequantize
from specdec.target.gguf_file import GGUFFile

FILES = ("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf")


def numpy_way(raw: np.ndarray, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind)))


def best_times(raw: np.ndarray, kind: gguf.GGMLQuantizationType, repeats: int) -> tuple[float, float, bool]:
    """(numpy seconds, torch seconds, bitwise equal) for one tensor."""
    times = {numpy_way: float("inf"), dequantize: float("inf")}
    results = {}
    for i in range(repeats):
        for way in (numpy_way, dequantize) if i % 2 == 0 else (dequantize, numpy_way):
            start = time.perf_counter()
            results[way] = way(raw, kind)
            times[way] = min(times[way], time.perf_counter() - start)
    same = torch.equal(results[numpy_way].view(torch.int32), results[dequantize].reshape(results[numpy_way].shape).view(torch.int32))
    return times[numpy_way], times[dequantize], same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache/specdec/gguf")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = [args.gguf_dir / name for name in FILES]
    if not all(p.is_file() for p in paths):
        print(f"skipped: the default pair's GGUF files are not in {args.gguf_dir}")
        return
    seconds = defaultdict(lambda: [0, 0.0, 0.0])  # type -> [weights, numpy s, torch s]
    mismatched = []
    for path in paths:
        f = GGUFFile.open(path)
        for name, info in f.tensors.items():
            raw = f.raw(name)
            np.array(raw)  # fault the pages in before either side is timed
            kind = gguf.GGMLQuantizationType(info.ggml_type)
            t_numpy, t_torch, same = best_times(raw, kind, args.repeats)
            row = seconds[kind.name]
            row[0] += int(np.prod(info.shape))
            row[1] += t_numpy
            row[2] += t_torch
            if not same:
                mismatched.append(f"{path.name}:{name}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; numpy {np.__version__} (one thread); "
          f"best of {args.repeats} per tensor; load average at the end: see below\n")
    print("| type | weights (M) | numpy s | torch s | ratio | numpy M/s | torch M/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = [0, 0.0, 0.0]
    for kind, (n, t_numpy, t_torch) in sorted(seconds.items()):
        total = [total[0] + n, total[1] + t_numpy, total[2] + t_torch]
        print(f"| {kind} | {n / 1e6:.1f} | {t_numpy:.2f} | {t_torch:.2f} | {t_numpy / t_torch:.2f}x "
              f"| {n / t_numpy / 1e6:.0f} | {n / t_torch / 1e6:.0f} |")
    n, t_numpy, t_torch = total
    print(f"| all | {n / 1e6:.1f} | {t_numpy:.2f} | {t_torch:.2f} | {t_numpy / t_torch:.2f}x "
          f"| {n / t_numpy / 1e6:.0f} | {n / t_torch / 1e6:.0f} |")
    print(f"\nbitwise equal: {'all tensors' if not mismatched else 'NOT ' + ', '.join(mismatched)}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
