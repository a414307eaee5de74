"""`specdec bench latency`: batch-1 decoding, every system on the same prompts in one run.

Systems: our engine target-only (k = 0) and speculative (k from `-k`), transformers `generate()`
and assisted generation (`assistant_model=`) on the SAME converted weights, dtype and thread
count, and llama.cpp (llama-cpp-python, when installed) on the target's GGUF. All decode greedily
exactly `max_tokens` new tokens (EOS ignored, so every system does the same work). Prompts are
interleaved (each prompt runs on every system in turn) so drift in machine speed hits all alike.
Then a concurrency sweep: our engine's aggregate tokens/s with 1, 4, 8, 16 streams.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.eval import metrics, report
from specdec.eval.bootstrap import speedup
from specdec.eval.metrics import RequestTrace
from specdec.eval.runner import EncodedPrompt, encode_prompts, load_engine, run_concurrent
from specdec.eval.systems import SYSTEMS, load_decoders
from specdec.sampling_params import SamplingParams


@dataclass
class LatencyOptions:
    dataset: str = "humaneval"
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    max_tokens: int = 64
    limit: int | None = 10
    seed: int = 0
    max_prompt_tokens: int = 1024
    threads: int | None = None
    gguf: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    sweep_max_tokens: int = 32
    temperature: float = 0.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 2 or self.sweep_max_tokens < 1:
            raise ValueError("--max-tokens must be at least 2 and --sweep-max-tokens at least 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be positive")
        if any(n < 1 for n in self.concurrency):
            raise ValueError(f"--concurrency values must be positive, got {self.concurrency}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("--threads must be positive")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0")


# ---- the run ---------------------------------------------------------------------------------


def benchmark(config, opts: LatencyOptions) -> dict:
    """Time every system on the same prompts, then sweep our engine's concurrency."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    engine = load_engine(config)
    prompts = encode_prompts(
        engine, opts.dataset, opts.limit, opts.seed, opts.max_prompt_tokens, opts.max_tokens
    )
    context_len = max(len(p.token_ids) for p in prompts) + opts.max_tokens + 16
    threads = torch.get_num_threads()
    decoders, skipped = load_decoders(
        engine, config, opts.systems, opts.gguf, threads, context_len, opts.temperature
    )
    traces = time_systems(decoders, prompts, opts)
    systems = summarize_systems(traces, config)
    for name, reason in skipped.items():
        systems[name] = {"status": "skipped", "reason": reason}
    sweep = concurrency_sweep(engine, prompts, config, opts)
    return {
        "threads": torch.get_num_threads(),
        "prompts": [{"id": p.id, "prompt_tokens": len(p.token_ids)} for p in prompts],
        "systems": {name: systems[name] for name in SYSTEMS if name in systems},
        "concurrency": sweep,
    }


def time_systems(
    decoders: dict, prompts: list[EncodedPrompt], opts: LatencyOptions
) -> dict[str, list[RequestTrace]]:
    """Each prompt on each system in turn, after one short untimed warm-up run per system."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    # assisted generation repeats deprecation notices about its inner generate() call each run
    hf_logging.set_verbosity_error()
    for decoder in decoders.values():
        decoder.decode(prompts[0].token_ids, 4)
    traces: dict[str, list[RequestTrace]] = {name: [] for name in decoders}
    total = len(prompts) * len(decoders)
    with tqdm(total=total, desc="bench latency", unit="run", disable=not opts.progress) as bar:
        for prompt in prompts:
            for name, decoder in decoders.items():
                bar.set_postfix_str(f"{prompt.id} · {name}")
                traces[name].append(decoder.decode(prompt.token_ids, opts.max_tokens))
                bar.update(1)
    return traces


def summarize_systems(traces: dict[str, list[RequestTrace]], config) -> dict[str, dict]:
    """Per system: decode metrics, tokens/s ratios to our target-only and speculative runs (each
    with a 95% bootstrap interval over prompts), token agreement with our target-only run."""
    out = {name: {"status": "ok", **metrics.decode_metrics(ts)} for name, ts in traces.items()}
    base = traces.get("specdec-target-only")
    ours = traces.get("specdec-speculative")
    for name, summary in out.items():
        summary["vs_target_only"] = speedup(traces[name], base).as_dict() if base else None
        summary["specdec_speedup_over_this"] = speedup(ours, traces[name]).as_dict() if ours else None
        if base is not None:
            same = [a.token_ids == b.token_ids for a, b in zip(traces[name], base)]
            summary["same_tokens_as_target_only"] = sum(same) / len(same)
    if "specdec-speculative" in out:
        k = config.num_speculative_tokens
        out["specdec-speculative"]["k"] = f"adaptive<={k}" if config.adaptive_k else k
    return out


def concurrency_sweep(engine, prompts: list[EncodedPrompt], config, opts: LatencyOptions) -> list[dict]:
    """Aggregate tokens/s of our engine with N streams at once, target-only and speculative."""
    from tqdm.auto import tqdm

    params = SamplingParams(temperature=0.0, max_tokens=opts.sweep_max_tokens, ignore_eos=True)
    modes = [("specdec-target-only", 0)]
    if engine.proposer is not None:
        modes.append(("specdec-speculative", config.num_speculative_tokens))
    rows = []
    runs = [(n, mode, k) for n in opts.concurrency for mode, k in modes]
    for n, mode, k in tqdm(runs, desc="concurrency sweep", unit="run", disable=not opts.progress or not runs):
        batch = [prompts[i % len(prompts)].token_ids for i in range(n)]
        traces, seconds, stats = run_concurrent(engine, batch, params, k)
        tokens = sum(t.num_output_tokens for t in traces)
        rows.append({
            "system": mode, "k": k, "streams": n, "num_output_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "ttft_ms_mean": metrics.distribution([1000 * t.ttft for t in traces])["mean"],
            "acceptance_rate": stats.acceptance_rate if k else None,
            "queued": max(0, n - config.max_num_seqs),
        })
    return rows


# ---- report ----------------------------------------------------------------------------------


def table(result: dict) -> str:
    headers = ["system", "tok/s", "TTFT p50 ms", "TPOT ms", "ITL p50 ms", "ITL p99 ms", "TBT p50 ms",
               "TBT p99 ms", "x our target-only", "specdec spec. is Nx faster", "same tokens"]
    rows = []
    for name, s in result["systems"].items():
        if s["status"] != "ok":
            rows.append([name, "skipped", *[None] * (len(headers) - 2)])
            continue
        rows.append([
            name + (f" (k={s['k']})" if "k" in s else ""), s["tokens_per_s"], s["ttft_ms"]["p50"],
            s["tpot_ms"]["mean"], s["itl_ms"]["p50"], s["itl_ms"]["p99"], s["tbt_ms"]["p50"],
            s["tbt_ms"]["p99"], report.interval(s["vs_target_only"], "x"),
            report.interval(s["specdec_speedup_over_this"], "x"),
            s.get("same_tokens_as_target_only"),
        ])
    skipped = [f"- {n} skipped: {s['reason']}" for n, s in result["systems"].items() if s["status"] != "ok"]
    return "\n".join([report.markdown_table(headers, rows), *([""] + skipped if skipped else [])])


def sweep_table(rows: list[dict]) -> str:
    return report.markdown_table(
        ["system", "streams", "aggregate tok/s", "mean TTFT ms", "acceptance rate"],
        [[r["system"], r["streams"], r["tokens_per_s"], r["ttft_ms_mean"], r["acceptance_rate"]] for r in rows],
    )


def plot_systems(result: dict, path: Path) -> Path:
    ok = {n: s for n, s in result["systems"].items() if s["status"] == "ok"}
    fig, (ax_tps, ax_lat) = report.new_figure(ncols=2)
    names = list(ok)
    ax_tps.barh(names, [ok[n]["tokens_per_s"] for n in names], color="tab:blue")
    ax_tps.set(title="batch-1 decoding speed", xlabel="tokens/s")
    ax_tps.invert_yaxis()
    ttft = [ok[n]["ttft_ms"]["p50"] or 0.0 for n in names]
    tpot = [ok[n]["tpot_ms"]["mean"] or 0.0 for n in names]
    y = range(len(names))
    ax_lat.barh([i - 0.2 for i in y], ttft, height=0.4, label="TTFT p50")
    ax_lat.barh([i + 0.2 for i in y], tpot, height=0.4, label="TPOT mean")
    ax_lat.set(title="latency", xlabel="ms", yticks=list(y), yticklabels=names)
    ax_lat.invert_yaxis()
    ax_lat.legend()
    for ax in (ax_tps, ax_lat):
        ax.grid(axis="x", alpha=0.3)
    return report.save_figure(fig, path)


def plot_sweep(rows: list[dict], path: Path) -> Path:
    fig, (ax,) = report.new_figure()
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ax.plot([r["streams"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=system)
    ax.set(title="our engine, concurrent streams", xlabel="streams", ylabel="aggregate tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    return report.save_figure(fig, path)


def write_report(out: Path, meta: dict, opts: LatencyOptions, engine_config, result: dict) -> list[Path]:
    payload = {"meta": meta, "options": asdict(opts), "engine": asdict(engine_config), "results": result}
    n, max_tokens = len(result["prompts"]), opts.max_tokens
    sections = [(
        "Batch-1 decoding",
        table(result) + f"\n\n{n} {opts.dataset} prompts, "
        f"{'greedy' if opts.temperature == 0 else f'sampled at temperature {opts.temperature}'}, "
        f"{max_tokens} new tokens each (EOS "
        f"ignored), {result['threads']} threads, dtype {engine_config.dtype}; our engine's weight "
        f"quantization: target {engine_config.target_quant}, draft {engine_config.draft_quant} "
        "(transformers runs the same weights dense). TTFT: request to first token; TPOT: (E2E - TTFT) / (tokens - 1); ITL: gaps between streamed chunks (a speculative "
        "chunk carries several tokens); TBT: each chunk's gap shared by its tokens. 'same tokens': "
        "share of prompts whose output equals our target-only output. Ratios of tokens/s (all tokens / "
        "all request time, on the same prompts) come with a 95% bootstrap interval over prompts.",
    )]
    files = [report.write_json(out / "latency.json", payload)]
    if result["concurrency"]:
        sections.append(("Concurrency sweep (our engine)", sweep_table(result["concurrency"]) + (
            f"\n\nN streams started together, {opts.sweep_max_tokens} greedy new tokens each (prompts "
            f"reused in turn); aggregate tok/s = all new tokens / wall time. Streams beyond "
            f"--max-num-seqs ({engine_config.max_num_seqs}) wait in the queue.")))
    files.append(report.write_markdown(out / "latency.md", "Latency benchmark", meta, sections))
    if any(s["status"] == "ok" for s in result["systems"].values()):
        files.append(plot_systems(result, out / "latency_systems.png"))
    if result["concurrency"]:
        files.append(plot_sweep(result["concurrency"], out / "concurrency.png"))
    return files
