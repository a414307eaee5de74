"""`python -m specdec.eval.moe_bench MODEL.gguf --llama-bin DIR`: an MoE GGUF in specdec and llama.cpp, side by side.

The same file (e.g. `specdec.eval.moe_synthetic`'s Qwen3-30B-A3B-shaped Q4_K_M), the same threads,
one sitting, specdec first then llama.cpp's `llama-bench`:

- one-row decode: 128 forwards of one row after a short prompt, as `tg128` (tok/s);
- prefill: one forward of 512 tokens, as `pp512` (tok/s);
- forwards of 1, 2, 4, 6, 8 rows after the prompt (a verify window is k + 1 rows), each relative to
  the engine's own one-row forward, as `llama-bench -p 1,2,4,6,8 -n 0` (its `pp1`...`pp8`);
- the distinct experts a layer each window size read (what a verify window costs an MoE).

Each round runs specdec, then llama.cpp; `--rounds` of them alternate, so both share the machine's
drift (measured here: a third within the hour), and each figure is the median over the rounds.
Ratios are specdec / llama.cpp. Run it with nothing else running: with 2 cores anything else makes
the threads wait on each other.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec.eval import report
from specdec.expert_stats import distinct_experts
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.quant.modes import QUANT_MODES
from specdec.target.runner import ModelRunner, Window

ROWS = (1, 2, 4, 6, 8)
PROMPT = 32  # tokens before the decode and the row forwards (llama-bench's tg starts from none)


def token_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 150000), (n,), generator=g).tolist()


def load_runner(path: Path, quant: str) -> tuple[ModelRunner, float]:
    """specdec's runner over `path` (bf16 activations, `quant` weights) and the seconds it took."""
    t0 = time.perf_counter()
    model = load_model(resolve_model(str(path), progress=True), torch.bfloat16, "cpu", quant)
    return ModelRunner.build(model, 16, None, num_blocks=64), time.perf_counter() - t0


def specdec_figures(runner: ModelRunner, repeats: int, rows_measured: tuple[int, ...] = ROWS) -> dict:
    """tg128, pp512, the row forwards (`rows_measured`) and the experts they read, of specdec's `runner`."""
    config = runner.model.config
    need = max(512, PROMPT + 128, PROMPT + max(rows_measured, default=0))
    if runner.max_positions < need:
        raise ValueError(f"the model's context is {runner.max_positions} positions; these figures need {need} "
                         f"(a 512-token prefill, 128 tokens decoded after {PROMPT})")
    ids = token_ids(PROMPT + 128 + 512, config.vocab_size)

    def fresh(n: int):
        table = runner.new_table()
        table.ensure_slots(n)
        return table

    prefill = []
    for _ in range(repeats):
        table = fresh(512)
        start = time.perf_counter()
        runner.forward([Window(table, ids[:512], 1)])
        prefill.append(time.perf_counter() - start)
        runner.pool.free(table.block_ids)
    decode = []
    table = fresh(PROMPT + 128)
    runner.forward([Window(table, ids[:PROMPT], 1)])
    for i in range(128):
        start = time.perf_counter()
        runner.forward([Window(table, [ids[PROMPT + i]], 1)])
        decode.append(time.perf_counter() - start)
    forwards, experts = {}, {}
    for rows in rows_measured:
        times = []
        for _ in range(repeats * 3):
            table.num_computed = PROMPT
            start = time.perf_counter()
            runner.forward([Window(table, ids[PROMPT : PROMPT + rows], rows)])
            times.append(time.perf_counter() - start)
        forwards[rows] = statistics.median(times)
        ids_now = runner.expert_ids()
        if ids_now is not None:
            experts[rows] = distinct_experts(ids_now, [(0, rows)], config.moe.num_experts)[0]
    runner.pool.free(table.block_ids)
    return {"tg128": 1 / statistics.mean(decode), "pp512": 512 / statistics.median(prefill),
            "forward_s": forwards, "experts": experts}


def median_of(rounds: list[dict]) -> dict:
    """The median of each figure over the rounds (forward times per row count too)."""
    out = {key: statistics.median(r[key] for r in rounds) for key in ("tg128", "pp512")}
    out["forward_s"] = {rows: statistics.median(r["forward_s"][rows] for r in rounds) for rows in rounds[0]["forward_s"]}
    out["rounds"] = rounds
    return out


def llama_figures(path: Path, llama_bin: Path, threads: int, repeats: int, rows_measured: tuple[int, ...] = ROWS) -> dict:
    """`llama-bench -p 512 -n 128` and `-p 1,2,4,6,8 -n 0` (`rows_measured`) on `path` (JSON output parsed)."""

    def bench(*args: str) -> list[dict]:
        cmd = [str(llama_bin / "llama-bench"), "-m", str(path), "-t", str(threads), "-r", str(repeats), "-o", "json", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    out = {"forward_s": {}}
    for row in bench("-p", "512", "-n", "128"):
        out["pp512" if row["n_prompt"] else "tg128"] = row["avg_ts"]
    for row in bench("-p", ",".join(map(str, rows_measured)), "-n", "0") if rows_measured else []:
        out["forward_s"][int(row["n_prompt"])] = row["avg_ns"] / 1e9
    return out


def table(ours: dict, llama: dict | None) -> str:
    lines = ["| | specdec | llama.cpp | ratio |", "|---|---|---|---|"]
    for key, name in (("tg128", "one-row decode, tok/s (tg128)"), ("pp512", "prefill 512, tok/s (pp512)")):
        theirs = llama.get(key) if llama else None
        lines.append(f"| {name} | {ours[key]:.1f} | " + (f"{theirs:.1f} | {ours[key] / theirs:.2f}x |" if theirs else "- | |"))
    for rows in ROWS:
        rel = ours["forward_s"][rows] / ours["forward_s"][1]
        theirs = llama["forward_s"].get(rows) / llama["forward_s"][1] if llama else None
        lines.append(f"| {rows}-row forward, ms (x its own 1-row) | {1e3 * ours['forward_s'][rows]:.1f} ({rel:.2f}x) | "
                     + (f"{1e3 * llama['forward_s'][rows]:.1f} ({theirs:.2f}x) |" if llama else "- |")
                     + (f" {rel / theirs:.2f} |" if llama else " |"))
    if ours["experts"]:
        lines += ["", "| rows in the window | " + " | ".join(map(str, ROWS)) + " |", "|---|" + "---|" * len(ROWS),
                  "| distinct experts a layer | " + " | ".join(f"{ours['experts'][r]:.1f}" for r in ROWS) + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.eval.moe_bench", description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-bin", type=Path, help="llama.cpp's build/bin (omit: specdec only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each figure within a round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="specdec then llama.cpp, this many times alternating; medians reported (the "
                             "machine's speed drifts within minutes: alternating shares the drift)")
    parser.add_argument("--quant", default="gguf", choices=QUANT_MODES,
                        help="specdec's weight format (default: gguf, the target's: the file's Q4_K / Q6_K blocks as stored)")
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json (command, commit, machine, figures)")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        parser.error(f"{args.gguf} is not a file")
    torch.set_num_threads(args.threads)
    runner, load_s = load_runner(args.gguf, args.quant)
    rounds = []
    for _ in range(max(1, args.rounds)):
        rounds.append((specdec_figures(runner, args.repeats),
                       llama_figures(args.gguf, args.llama_bin, args.threads, args.repeats) if args.llama_bin else None))
    ours = {**median_of([r[0] for r in rounds]), "load_s": load_s, "experts": rounds[0][0]["experts"]}
    llama = median_of([r[1] for r in rounds]) if args.llama_bin else None
    words = argv if argv is not None else sys.argv[1:]
    meta = {**report.provenance(args, words), "command": "python -m specdec.eval.moe_bench " + shlex.join(words)}
    summary = (f"{args.gguf.name} ({args.gguf.stat().st_size / 1e9:.2f} GB), {args.threads} threads, "
               f"{meta['machine']['kernels']}; llama.cpp: {args.llama_bin or 'not run'}; specdec loaded in "
               f"{ours['load_s']:.1f} s")
    print(f"{summary}\n\n{table(ours, llama)}")
    if args.out:
        report.write_json(args.out.with_suffix(".json"), {"meta": meta, "specdec": ours, "llama.cpp": llama})
        report.write_markdown(args.out.with_suffix(".md"), "MoE GGUF: specdec beside llama-bench", meta,
                              [("Figures", f"{summary}\n\n{table(ours, llama)}")])


if __name__ == "__main__":
    main()
