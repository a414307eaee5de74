"""One-row decode of an MLA GGUF with its layers in the C layer loop (decoder.c) against the Python
layer loop on the same loaded model, alternated, nothing else changed:
    python docs/results/issue37/c_loop_ab.py FILE.gguf [ROUNDS]
Each round times 128 one-row forwards after a 32-token prompt on each loop (as moe_bench's tg128)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.eval.moe_bench import load_runner
from specdec.target.runner import Window


def decode(runner, tokens: int = 128) -> float:
    table = runner.new_table()
    assert table.ensure_slots(32 + tokens)
    runner.forward([Window(table, list(range(100, 132)), 1)])
    t0 = time.perf_counter()
    for i in range(tokens):
        runner.forward([Window(table, [200 + i], 1)])
    elapsed = time.perf_counter() - t0
    table.free()
    return tokens / elapsed


def main() -> None:
    path, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    runner, _ = load_runner(path, "gguf")
    model, stack = runner.model, runner.model._layer_stack
    assert stack is not None, "the C layer loop does not take this model"
    figures: dict[str, list[float]] = {"C loop": [], "Python loop": []}
    with torch.inference_mode():
        decode(runner, 16)  # warm both
        for _ in range(rounds):
            for name, s in (("C loop", stack), ("Python loop", None)):
                model.use_layer_stack(s)
                figures[name].append(decode(runner))
    c, py = (statistics.median(figures[k]) for k in ("C loop", "Python loop"))
    print(f"{path.name}, {torch.get_num_threads()} threads, {rounds} rounds alternated")
    for name, values in figures.items():
        print(f"{name:12s} tok/s: " + " ".join(f"{v:.1f}" for v in values) + f"  median {statistics.median(values):.1f}")
    print(f"C loop / Python loop: {c / py:.2f}x")


if __name__ == "__main__":
    main()
