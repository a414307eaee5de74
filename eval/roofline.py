"""`python -m specdec.eval.roofline`: how fast batch-1 decoding can be on this machine, whatever the code.

Two measured ceilings bound every forward pass of a model whose weights are read once per pass:

- memory: the pass reads the model's weight bytes (`ModelCost.bytes_per_token`), so it takes at
  least bytes / read bandwidth (2 threads streaming a 1.2 GB buffer, `roofline.c`);
- compute: each row does the model's multiply-adds (`macs_per_token`, the linears), at most at the
  int8 instruction's peak (independent registers, no memory), per instruction-set level.

A forward of `rows` rows costs at least max(memory, rows x compute); from those bounds follow a
decode step's floor, a prefill's ceiling, and the ceiling of speculative decoding with a draft
whose per-token acceptance is `a` (each step drafts k tokens, one draft forward each, then
verifies k + 1 rows in one target forward, and emits E(a, k) = (1 - a^(k+1)) / (1 - a) tokens).
The same memory floor applies to llama.cpp: its `tg128` cannot beat the GGUF's bytes over the
bandwidth. The workloads' figures (prompt tokens, acceptance) are arguments, measured elsewhere:
the defaults are `docs/results/acceptance.md` (p/token of the i.i.d. fit, k = 4) and the mean
prompt of `specdec bench latency --limit 10` on each dataset.

A ceiling that needs no acceptance model (`--oracle DATASET[:N]`): the target's greedy answers to
the dataset's first N prompts, the draft (as the engine loads it) teacher-forced over them, and an
oracle that drafts exactly the run of tokens the draft guesses right from each position and nothing
where it guesses the first one wrong, every forward at the floors above. No chain proposer of this
draft emits more per step, however it picks its lengths (a drafter that stops on its own confidence
beats the one-rate model; prompt lookup, which proposes what the draft cannot, is left out).

Run it with nothing else running (`uptime` first): both measurements fall with a busy core.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import kernel_abi, native
from specdec.target.moe import SparseMoE
from specdec.target.quant.modes import QUANT_MODES

ROOFLINE_SOURCE = Path(__file__).with_name("roofline.c")
FUNCTIONS = ("roofline_read_bandwidth", "roofline_int8_peak")
BANDWIDTH_BYTES = 1200 << 20  # about a target's weights: no cache level holds it
PEAK_ROUNDS = 20_000_000  # ~0.1-0.3 s per level and try
TRIES = 5  # the best of: memory bandwidth on a shared machine varies by ~30% from pass to pass
# name:prompt_tokens:acceptance (see the module docstring for their sources)
DEFAULT_WORKLOADS = ("humaneval:101:0.869", "sharegpt:267:0.742")


@dataclass(frozen=True)
class Machine:
    """What this machine's memory and int8 units allow, at `threads` threads."""

    threads: int
    read_bytes_per_s: float
    int8_macs_per_s: dict[str, float]  # level name -> multiply-adds/s


@dataclass(frozen=True)
class ModelCost:
    """What one row of a forward pass reads and computes in a model's linears."""

    name: str
    bytes_per_token: int  # weight bytes read once per forward pass
    macs_per_token: int  # multiply-adds of one row, the LM head's included
    head_macs: int  # the LM head's share: a prompt needs logits of its last row only

    def forward_s(self, machine: Machine, level: str, rows: int, logit_rows: int | None = None) -> float:
        """The floor of a `rows`-row forward that computes logits for `logit_rows` of them (all by
        default): memory or compute, whichever binds."""
        logit_rows = rows if logit_rows is None else logit_rows
        macs = rows * (self.macs_per_token - self.head_macs) + logit_rows * self.head_macs
        return max(self.bytes_per_token / machine.read_bytes_per_s, macs / machine.int8_macs_per_s[level])


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    acceptance: float  # per-token acceptance probability of the draft (0 <= a < 1)

    @classmethod
    def parse(cls, text: str) -> "Workload":
        try:
            name, prompt, acceptance = text.split(":")
            workload = cls(name, int(prompt), float(acceptance))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected name:prompt_tokens:acceptance, "
                                             "e.g. humaneval:101:0.869") from None
        if workload.prompt_tokens < 1 or not 0.0 <= workload.acceptance < 1.0:
            raise argparse.ArgumentTypeError(f"{text!r}: prompt_tokens >= 1 and 0 <= acceptance < 1")
        return workload


def expected_tokens(acceptance: float, k: int) -> float:
    """E(a, k) = 1 + a + ... + a^k: tokens a step of k drafts emits on average."""
    return sum(acceptance ** i for i in range(k + 1))


def request_s(target: ModelCost, draft: ModelCost | None, machine: Machine, level: str, workload: Workload,
              max_tokens: int, k: int) -> float:
    """The floor of one request: the prompt through both models (one forward each), then
    `max_tokens - 1` tokens at a step of k drafts (k = 0: plain decoding, the draft unused)."""
    prefill = target.forward_s(machine, level, workload.prompt_tokens, 1)
    if k == 0 or draft is None:
        return prefill + (max_tokens - 1) * target.forward_s(machine, level, 1)
    prefill += draft.forward_s(machine, level, workload.prompt_tokens, 1)
    step = k * draft.forward_s(machine, level, 1) + target.forward_s(machine, level, k + 1)
    return prefill + (max_tokens - 1) * step / expected_tokens(workload.acceptance, k)


def best_speculative(target: ModelCost, draft: ModelCost, machine: Machine, level: str, workload: Workload,
                     max_tokens: int, max_k: int) -> tuple[int, float]:
    """(k, tokens/s) of the fastest fixed k in 1..max_k, counting the prompt."""
    times = {k: request_s(target, draft, machine, level, workload, max_tokens, k) for k in range(1, max_k + 1)}
    k = min(times, key=times.get)
    return k, max_tokens / times[k]


def oracle_request_s(target: ModelCost, draft: ModelCost, machine: Machine, level: str, prompt_tokens: int,
                     agrees: list[bool], cap: int) -> float:
    """The floor of one request under the oracle drafter: both prompts, then from each position the
    run of tokens the draft guesses right (`agrees[i]`: its guess of answer token i + 1, after the
    target's tokens before it, is the target's), at most `cap`, drafted one row each and verified
    with the target's own next token in one forward of run + 1 rows; no draft where the run is 0.
    The answer is `len(agrees) + 1` tokens, the first from the prompt's forward."""
    seconds = target.forward_s(machine, level, prompt_tokens, 1) + draft.forward_s(machine, level, prompt_tokens, 1)
    i = 0
    while i < len(agrees):
        run = 0
        while i + run < len(agrees) and agrees[i + run] and run < cap:
            run += 1
        seconds += run * draft.forward_s(machine, level, 1) + target.forward_s(machine, level, run + 1)
        i += run + 1
    return seconds


def draft_agreement(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, list[bool]]]:
    """Per prompt: its length and, for each answer token after the first, whether the draft's greedy
    guess after the target's tokens before it is the target's. The target's greedy answer
    (`engine.generate`), then the draft as the engine loaded it (its quantization and cut head)
    over prompt + answer in one forward."""
    from specdec.sampling_params import SamplingParams
    from specdec.target.runner import Window

    draft = engine.proposer.runner
    head_ids = getattr(draft.model, "head_ids", None)
    runs = []
    for prompt in prompts:
        answer = engine.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=max_tokens))[0].token_ids
        ids = list(prompt) + list(answer)
        table = draft.new_table()
        try:
            table.ensure_slots(len(ids))
            guess = draft.forward([Window(table, ids, len(ids))]).argmax(-1)  # guess[j]: of ids[j + 1]
        finally:
            table.free()
        guess = (head_ids.to(guess.device)[guess] if head_ids is not None else guess).tolist()
        runs.append((len(prompt), [guess[len(prompt) + i - 1] == answer[i] for i in range(1, len(answer))]))
    return runs


def oracle_report(machine: Machine, target: ModelCost, draft: ModelCost, runs: dict[str, list[tuple[int, list[bool]]]],
                  cap: int, llama_tg: float | None) -> str:
    """The oracle's ceilings as markdown, per level and dataset, beside target-only's."""
    head = ("| level | dataset | prompts | the draft's guess is the target's | target-only tok/s "
            "| oracle speculative tok/s | oracle / target-only |")
    lines = [f"Oracle ceilings (the draft's own guesses, runs of at most {cap}; the prompt counted):", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for level in machine.int8_macs_per_s:
        for name, per_prompt in runs.items():
            tokens = sum(len(agrees) + 1 for _, agrees in per_prompt)
            plain = sum(request_s(target, None, machine, level, Workload(name, n, 0.0), len(agrees) + 1, 0)
                        for n, agrees in per_prompt)
            oracle = sum(oracle_request_s(target, draft, machine, level, n, agrees, cap) for n, agrees in per_prompt)
            guessed = sum(sum(agrees) for _, agrees in per_prompt) / max(1, sum(len(a) for _, a in per_prompt))
            lines.append(f"| {level} | {name} | {len(per_prompt)} | {guessed:.3f} | {_vs(tokens / plain, llama_tg)} "
                         f"| {_vs(tokens / oracle, llama_tg)} | {plain / oracle:.2f}x |")
    return "\n".join(lines)


def model_cost(model: torch.nn.Module, name: str) -> ModelCost:
    """Bytes and multiply-adds per token of `model`'s linears: `QLinear` tiles as stored, any other
    `nn.Linear` as its weight (the embedding is a row lookup: not counted); an MoE block's experts
    count for the share a token reads (top k of E)."""
    from specdec.target.quant.qlinear import QLinear  # after the kernels' level is settled

    share = {id(m): b.top_k / b.num_experts for b in model.modules() if isinstance(b, SparseMoE)
             for m in b.experts.modules()}
    nbytes = macs = head_macs = 0
    for path, module in model.named_modules():
        if isinstance(module, QLinear):
            weight = module.tiles
        elif isinstance(module, torch.nn.Linear):
            weight = module.weight
        else:
            continue
        part = share.get(id(module), 1.0)
        nbytes += round(part * weight.numel() * weight.element_size())
        macs += round(part * module.in_features * module.out_features)
        if path.split(".")[-1] == "lm_head":
            head_macs += module.in_features * module.out_features
    if macs == 0:
        raise ValueError(f"{name}: no linear layers found")
    return ModelCost(name, nbytes, macs, head_macs)


def gguf_bytes_per_token(paths: list[Path]) -> int:
    """What llama.cpp reads per token of a GGUF model: every tensor but the token embedding (a row
    lookup), which is read whole when it doubles as the output matrix (no `output.weight`); of an
    MoE's stacked experts (`*_exps`), the share of the experts a token uses."""
    from specdec.target.gguf_file import GGUFFile

    gguf = GGUFFile.open(paths if len(paths) > 1 else paths[0])
    tensors, arch = gguf.tensors, gguf.metadata.get("general.architecture")
    used, experts = gguf.metadata.get(f"{arch}.expert_used_count"), gguf.metadata.get(f"{arch}.expert_count")
    tied = "output.weight" not in tensors
    return sum(t.nbytes * used // experts if "_exps." in n and experts else t.nbytes
               for n, t in tensors.items() if n != "token_embd.weight" or tied)


def measure_machine(threads: int, levels: list[str]) -> Machine:
    """Read bandwidth and each level's int8 peak, at `threads` threads: the best of `TRIES`."""
    out = ctypes.c_double()
    lib = _library(levels[-1])
    kernel_abi.raise_for_status(lib.roofline_read_bandwidth(BANDWIDTH_BYTES, threads, TRIES, ctypes.byref(out)),
                                "roofline_read_bandwidth")
    bandwidth = out.value
    peaks = {}
    for level in levels:
        lib = _library(level)
        for _ in range(TRIES):
            kernel_abi.raise_for_status(lib.roofline_int8_peak(PEAK_ROUNDS, threads, ctypes.byref(out)),
                                        "roofline_int8_peak")
            peaks[level] = max(peaks.get(level, 0.0), out.value)
    return Machine(threads, bandwidth, peaks)


def kernel(level: native.SimdLevel | str | None = None) -> native.NativeKernel:
    """The measuring kernels (`roofline.c`) built for `level`."""
    return native.simd_kernel((ROOFLINE_SOURCE,), FUNCTIONS, level)


def _library(level: str) -> ctypes.CDLL:
    """The measuring kernels at `level`, loaded with `SPECDEC_ISA` held there for the call: every
    level the machine runs is measured, whatever the engine is held to."""
    held = os.environ.get(native.ISA_ENV)
    os.environ[native.ISA_ENV] = level
    try:
        kernel_ = kernel(level)
        lib = kernel_.load()
    finally:
        if held is None:
            os.environ.pop(native.ISA_ENV, None)
        else:
            os.environ[native.ISA_ENV] = held
    if lib is None:
        raise SystemExit(f"the roofline kernels do not run at {level}: {kernel_.unavailable_reason()}")
    return lib


def report(machine: Machine, target: ModelCost, draft: ModelCost | None, gguf_target_bytes: int | None,
           workloads: list[Workload], max_tokens: int, max_k: int, gguf_draft_bytes: int | None = None) -> str:
    """The ceilings as markdown: per level, and against llama.cpp's memory floor where known."""
    bw = machine.read_bytes_per_s
    lines = [f"Machine: {machine.threads} threads · read bandwidth {bw / 1e9:.1f} GB/s · int8 peak "
             + ", ".join(f"{lv} {p / 1e9:.0f} GMAC/s" for lv, p in machine.int8_macs_per_s.items()), ""]
    models = [target] + ([draft] if draft else [])
    lines += ["| model | weight bytes / token | multiply-adds / token | decode floor (memory) |",
              "|---|---|---|---|"]
    lines += [f"| {m.name} | {m.bytes_per_token / 1e9:.3f} GB | {m.macs_per_token / 1e9:.2f} G "
              f"| {1e3 * m.bytes_per_token / bw:.1f} ms |" for m in models]
    llama_tg = None
    if gguf_target_bytes:
        llama_tg = bw / gguf_target_bytes
        lines.append(f"| llama.cpp, the target's GGUF | {gguf_target_bytes / 1e9:.3f} GB | | "
                     f"{1e3 / llama_tg:.1f} ms: tg128 at most {llama_tg:.1f} tok/s |")
    if gguf_draft_bytes and draft:
        lines.append(f"| llama.cpp, the draft's GGUF | {gguf_draft_bytes / 1e9:.3f} GB | | {1e3 * gguf_draft_bytes / bw:.1f} ms |")
    best_k = f"; speculative: the best fixed k <= {max_k}" if draft else ""
    lines += ["", f"Ceilings per level ({max_tokens} new tokens a request, the prompt counted{best_k}):", ""]
    head = "| level | prefill tok/s (512 tokens) | rows a target forward takes before compute binds |"
    head += "".join(f" {w.name} target-only tok/s |" for w in workloads)
    if draft:
        head += "".join(f" {w.name} speculative tok/s (a = {w.acceptance}) |" for w in workloads)
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for level in machine.int8_macs_per_s:
        peak = machine.int8_macs_per_s[level]
        knee = (target.bytes_per_token / bw) / (target.macs_per_token / peak)
        prefill = 512 / target.forward_s(machine, level, 512, 1)
        row = f"| {level} | {prefill:.0f} | {knee:.1f} |"
        for w in workloads:
            rate = max_tokens / request_s(target, draft, machine, level, w, max_tokens, 0)
            row += f" {_vs(rate, llama_tg)} |"
        if draft:
            for w in workloads:
                k, rate = best_speculative(target, draft, machine, level, w, max_tokens, max_k)
                row += f" {_vs(rate, llama_tg)}, k = {k} |"
        lines.append(row)
    if llama_tg:
        lines += ["", f"x: against llama.cpp's tg128 ceiling ({llama_tg:.1f} tok/s, which counts no prompt)."]
    return "\n".join(lines)


def _vs(rate: float, llama_tg: float | None) -> str:
    return f"{rate:.1f}" + (f" ({rate / llama_tg:.2f}x)" if llama_tg else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default-target")
    parser.add_argument("--draft", default="default-draft", help="'none': target only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workload", type=Workload.parse, action="append", dest="workloads",
                        help="name:prompt_tokens:acceptance, repeatable (default: "
                             + ", ".join(DEFAULT_WORKLOADS) + ")")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--target-quant", choices=QUANT_MODES, default=None, help="default: the engine's")
    parser.add_argument("--draft-quant", choices=QUANT_MODES, default=None, help="default: the engine's")
    parser.add_argument("--oracle", action="append", default=[], metavar="DATASET[:N]",
                        help="also the oracle drafter's ceiling on the first N (default 10) prompts of a dataset "
                             "(runs the pair: the target's greedy answers, the draft's guesses), repeatable")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.max_tokens < 1 or args.max_k < 1:
        parser.error("--threads, --max-tokens and --max-k must be at least 1")
    oracle = []
    for text in args.oracle:
        name, _, count = text.partition(":")
        if not name or (count and (not count.isdigit() or int(count) < 1)):
            parser.error(f"--oracle {text!r}: expected DATASET or DATASET:N with N >= 1")
        oracle.append((name, int(count) if count else 10))
    if oracle and args.draft == "none":
        parser.error("--oracle needs a draft")
    workloads = args.workloads or [Workload.parse(w) for w in DEFAULT_WORKLOADS]
    levels = [level.name for level in native.machine_levels()]
    if not levels:
        raise SystemExit(f"no level runs here: {native.describe_simd()}")
    print(f"load {os.getloadavg()[0]:.2f} (run it on a quiet machine); levels: {', '.join(levels)}", flush=True)
    machine = measure_machine(args.threads, levels)

    from specdec.config import EngineConfig
    from specdec.engine_parts import load_engine_parts
    from specdec.target.checkpoint_reader import gguf_paths
    from specdec.target.model_files import resolve_model

    draft_spec = None if args.draft == "none" else args.draft
    torch.set_num_threads(args.threads)
    config = EngineConfig(target=args.target, draft=draft_spec, proposer="draft" if draft_spec else "none",
                          target_quant=args.target_quant, draft_quant=args.draft_quant)
    engine = None
    if oracle:  # the engine's own models: its answers and guesses are what is priced
        from specdec.engine import Engine
        engine = Engine(config)
        target_model, draft_model = engine.target.model, engine.proposer.runner.model
    else:
        target_model, draft_model, _ = load_engine_parts(config)
    target = model_cost(target_model, f"target ({args.target})")
    draft = model_cost(draft_model, f"draft ({draft_spec})") if draft_model is not None else None
    paths = gguf_paths(resolve_model(args.target))
    draft_paths = gguf_paths(resolve_model(draft_spec)) if draft_spec else []
    gguf_target = gguf_bytes_per_token(paths) if paths else None
    print(report(machine, target, draft, gguf_target, workloads, args.max_tokens, args.max_k,
                 gguf_bytes_per_token(draft_paths) if draft_paths else None), flush=True)
    if engine is not None:
        from specdec.eval.datasets import DatasetNotInstalledError
        from specdec.eval.runner import encode_prompts

        runs = {}
        for name, count in oracle:
            try:
                prompts = [p.token_ids for p in encode_prompts(engine, name, count, 0, 1024, args.max_tokens)]
            except (ValueError, DatasetNotInstalledError) as error:  # an unknown name, a missing package
                raise SystemExit(f"specdec: --oracle {name}: {error}") from None
            runs[name] = draft_agreement(engine, prompts, args.max_tokens)
        llama_tg = machine.read_bytes_per_s / gguf_target if gguf_target else None
        print("\n" + oracle_report(machine, target, draft, runs, args.max_k, llama_tg))


if __name__ == "__main__":
    main()
