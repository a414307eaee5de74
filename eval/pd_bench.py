"""`specdec bench serve --pd`: prefill/decode disaggregation beside colocated serving, in one sitting.

For each layout it starts `specdec serve` on the same models (one at a time: on a small machine two
servers would time each other), runs the same two workloads, stops it:

    pd         --replicas 2 --prefill-replicas 1 --replica-cpus C/2   1 prefill + 1 decode replica
    colocated  --replicas 2 --replica-cpus C/2                          2 replicas, each does both
    plain      (one engine in one process, every core)

1. Long arrivals: `streams` requests decode (short prompts, `ignore_eos`, long answers); once they
   run, `long_prompts` prompts of `long_tokens` tokens arrive `gap_s` apart. Reported: the running
   streams' ITL (gap between streamed chunks) and TBT (a chunk's gap over the tokens it carried)
   p50/p99 from the first arrival to the last long prompt's first token, the long prompts' TTFT,
   throughput, and under PD the KV bytes moved and the pulls' time (from /metrics).
2. Short, low load: `short_requests` short prompts one at a time (where PD should lose: the
   handoff is pure overhead when nothing competes for the cores).

Every request is greedy; the answers of every layout are compared to the first layout's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LAYOUTS = ("pd", "colocated", "plain")
WARM_CHUNKS = 12  # chunks every running stream has streamed before the first long prompt arrives


@dataclass
class PDBenchOptions:
    model_args: list[str] = field(default_factory=list)  # passed to every `specdec serve` (--target ... )
    layouts: list[str] = field(default_factory=lambda: list(LAYOUTS))
    port: int = 8123
    cpus: int = field(default_factory=lambda: os.cpu_count() or 2)
    streams: int = 2
    stream_tokens: int = 4000  # stopped once the long prompts are in
    long_prompts: int = 3
    long_tokens: int = 1536
    long_answer_tokens: int = 16
    gap_s: float = 25.0
    short_requests: int = 6
    short_tokens: int = 64
    startup_timeout_s: float = 900.0
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [name for name in self.layouts if name not in LAYOUTS]
        if unknown or not self.layouts:
            raise ValueError(f"--layouts takes names among {', '.join(LAYOUTS)}, got {self.layouts}")
        if self.long_tokens < 16 or self.streams < 1 or self.long_prompts < 1:
            raise ValueError("--long-tokens >= 16, --streams >= 1 and --long-prompts >= 1 are needed")
        if self.cpus < 2 and ("pd" in self.layouts or "colocated" in self.layouts):
            raise ValueError("two replicas need at least 2 CPUs")


@dataclass
class Trace:
    """One streamed request: when it was sent, each chunk's arrival and token count, its text."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None


def layout_args(name: str, cpus: int) -> list[str]:
    half = str(max(1, cpus // 2))
    return {"pd": ["--replicas", "2", "--prefill-replicas", "1", "--replica-cpus", half],
            "colocated": ["--replicas", "2", "--replica-cpus", half], "plain": []}[name]


class Server:
    """`specdec serve` in a subprocess (its own process group: stopping it stops its replicas)."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        command = [sys.executable, "-m", "specdec.api.cli", "serve", "--port", str(port), *args]  # warmed up by default
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self._log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the server was not ready within {timeout:.0f}s; see {self._log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, ignore_eos: bool,
                 model: str, trace: Trace | None = None) -> Trace:
    """A greedy streamed completion of token ids into `trace` (logprobs 0 names each chunk's tokens)."""
    import json

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": 0, "ignore_eos": ignore_eos}
    trace = trace or Trace(time.perf_counter())
    trace.sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                choice = (json.loads(line[5:]).get("choices") or [{}])[0]
                count = len((choice.get("logprobs") or {}).get("tokens") or [])
                if count:
                    trace.times.append(time.perf_counter())
                    trace.tokens.append(count)
                    trace.text += choice.get("text") or ""
    except (httpx.HTTPError, RuntimeError, ValueError) as error:
        trace.error = f"{type(error).__name__}: {error}"
    except asyncio.CancelledError:  # a running stream, stopped once the long prompts are in
        pass
    return trace


WORDS = ("the model reads every weight once a token so a long prompt keeps the cores busy while other "
         "streams wait for their next token def return value list index cache block draft target verify "
         "accept reject sample prefill decode replica transfer lease router prefix key memory bandwidth "
         "compute python function class import for while if else with open read write print").split()


def prompts(url: str, opts: PDBenchOptions) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(stream prompts, long prompts, short prompts) as token ids, every one distinct (no prefix
    cache hit between them): HumanEval prompts for the streams and the short requests, HumanEval
    problems and solutions run together for the long ones (seeded word salad without the dataset)."""
    import random

    rng = random.Random(opts.seed)
    tokenize = lambda text: httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30,  # noqa: E731
                                       trust_env=False).json()["tokens"]
    try:
        from specdec.eval.datasets import humaneval_prompts

        problems = list(humaneval_prompts())
    except Exception:  # noqa: BLE001 - the dataset is not installed
        problems = []
    if len(problems) < opts.streams + opts.short_requests + 8:
        def salad(n: int) -> list[int]:
            return tokenize(f"{rng.random()} " + " ".join(rng.choice(WORDS) for _ in range(n)))[:n]
        return ([salad(48) for _ in range(opts.streams)], [salad(opts.long_tokens) for _ in range(opts.long_prompts)],
                [salad(32) for _ in range(opts.short_requests)])
    rng.shuffle(problems)
    streams = [tokenize(p.text) for p in problems[: opts.streams]]
    shorts = [tokenize(p.text) for p in problems[opts.streams : opts.streams + opts.short_requests]]
    rest = problems[opts.streams + opts.short_requests :]
    longs = []
    for i in range(opts.long_prompts):
        picked, ids = rest[i::opts.long_prompts], []
        for problem in picked:  # solved problems, then an open one last
            ids = tokenize("\n\n".join(p.text + p.reference for p in picked[: picked.index(problem) + 1]))
            if len(ids) >= opts.long_tokens:
                break
        if len(ids) < opts.long_tokens:
            raise RuntimeError(f"not enough HumanEval text for {opts.long_tokens}-token prompts")
        longs.append(ids[: opts.long_tokens])
    return streams, longs, shorts


async def long_arrivals(url: str, opts: PDBenchOptions, streams: list[list[int]], longs: list[list[int]],
                        model: str) -> dict:
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        live = [Trace(time.perf_counter()) for _ in streams]
        running = [asyncio.create_task(stream(client, url, p, opts.stream_tokens, True, model, trace))
                   for p, trace in zip(streams, live)]
        deadline = time.perf_counter() + 120
        while min(len(t.times) for t in live) < WARM_CHUNKS and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)  # every stream decodes steadily before the first arrival
        started = time.perf_counter()
        arrivals = []
        for i, prompt in enumerate(longs):
            arrivals.append(asyncio.create_task(stream(client, url, prompt, opts.long_answer_tokens, False, model)))
            if i + 1 < len(longs):
                await asyncio.sleep(opts.gap_s)
        long_traces = await asyncio.gather(*arrivals)
        window_end = max((t.times[0] for t in long_traces if t.times), default=time.perf_counter())
        ended = time.perf_counter()
        for task in running:  # they have decoded through the whole window: stop them
            task.cancel()
        stream_traces = await asyncio.gather(*running)
    itl, tbt, before = [], [], []
    for trace in stream_traces:
        for (a, b), n in zip(zip(trace.times, trace.times[1:]), trace.tokens[1:]):
            if b <= started:
                before.append(b - a)
            elif a < window_end:
                itl.append(b - a)
                tbt += [(b - a) / n] * n
    total_tokens = sum(sum(n for when, n in zip(t.times, t.tokens) if started <= when <= ended)
                       for t in stream_traces + long_traces)
    return {
        "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99), "tbt_p50_ms": _pct(tbt, 50),
        "tbt_p99_ms": _pct(tbt, 99), "itl_before_p50_ms": _pct(before, 50),
        "itl_p99_over_p50": (_pct(itl, 99) / _pct(itl, 50)) if itl else None,
        "long_ttft_s": [round(t.ttft, 3) if t.ttft is not None else None for t in long_traces],
        "long_ttft_p50_s": _pct([t.ttft for t in long_traces if t.ttft], 50) / 1000,
        "throughput_tok_s": total_tokens / (ended - started),
        "errors": [t.error for t in stream_traces + long_traces if t.error],
        "stream_ended_early": [t.times[-1] < window_end if t.times else True for t in stream_traces],
        "texts": [t.text for t in long_traces], "stream_texts": [t.text for t in stream_traces],
        # the raw timeline, seconds from the first arrival: each stream's chunks, each long prompt's
        "stream_chunks": [[round(x - started, 4) for x in t.times] for t in stream_traces],
        "stream_chunk_tokens": [t.tokens for t in stream_traces],
        "long_sent_first": [[round(t.sent - started, 3), round(t.times[0] - started, 3) if t.times else None]
                            for t in long_traces],
    }


async def short_low_load(url: str, shorts: list[list[int]], max_tokens: int, model: str) -> dict:
    traces = []
    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        for prompt in shorts:
            traces.append(await stream(client, url, prompt, max_tokens, True, model))
            await asyncio.sleep(0.5)
    ttft = [t.ttft for t in traces if t.ttft is not None]
    e2e = [t.times[-1] - t.sent for t in traces if t.times]
    tpot = [(t.times[-1] - t.times[0]) / max(1, sum(t.tokens) - 1) for t in traces if t.times]
    return {"ttft_p50_ms": _pct(ttft, 50), "tpot_p50_ms": _pct(tpot, 50), "e2e_p50_s": _pct(e2e, 50) / 1000,
            "errors": [t.error for t in traces if t.error], "texts": [t.text for t in traces]}


def transfer_counters(url: str) -> dict[str, float]:
    """The PD counters of /metrics (zeros without PD)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    wanted = {"specdec_kv_transfer_bytes_total": "bytes", "specdec_kv_transfer_seconds_total": "seconds",
              "specdec_kv_transfer_pulls_total": "pulls", "specdec_kv_transfer_recomputed_total": "recomputed",
              "specdec_kv_transfer_blocks_total": "blocks"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split(" ")[0]
        if name in wanted:
            out[wanted[name]] = float(line.split()[-1])
    return out


def run_layout(name: str, opts: PDBenchOptions, out: Path, port: int) -> dict:
    """Start the layout's server, run both workloads, stop it; RuntimeError when it cannot serve."""
    server = Server(opts.model_args + layout_args(name, opts.cpus), port, out / f"server-{name}.log")
    try:
        server.wait_ready(opts.startup_timeout_s)
        time.sleep(3.0)  # replicas report their caches; the router knows both
        streams, longs, shorts = prompts(server.url, opts)
        model = httpx.get(server.url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        before = transfer_counters(server.url)
        arrivals = asyncio.run(long_arrivals(server.url, opts, streams, longs, model))
        time.sleep(2.0)  # the last report of the counters
        after = transfer_counters(server.url)
        arrivals["transfer"] = {k: after[k] - before[k] for k in after}
        short = asyncio.run(short_low_load(server.url, shorts, opts.short_tokens, model))
        return {"long_arrivals": arrivals, "short_low_load": short}
    except httpx.HTTPError as exc:
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        server.stop()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def table(results: dict[str, dict]) -> str:
    """The side-by-side table (markdown)."""
    def cell(value, fmt: str = "{:.0f}") -> str:
        return "—" if value is None else fmt.format(value)

    names = list(results)
    rows = [("running streams' ITL p50 / p99 (ms)", lambda r: f"{cell(r['long_arrivals']['itl_p50_ms'])} / "
             f"{cell(r['long_arrivals']['itl_p99_ms'])}"),
            ("ITL p99 / p50", lambda r: cell(r["long_arrivals"]["itl_p99_over_p50"], "{:.2f}x")),
            ("running streams' TBT p50 / p99 (ms)", lambda r: f"{cell(r['long_arrivals']['tbt_p50_ms'])} / "
             f"{cell(r['long_arrivals']['tbt_p99_ms'])}"),
            ("ITL p50 before the arrivals (ms)", lambda r: cell(r["long_arrivals"]["itl_before_p50_ms"])),
            ("long prompts' TTFT p50 (s)", lambda r: cell(r["long_arrivals"]["long_ttft_p50_s"], "{:.2f}")),
            ("throughput while they arrive (tok/s)", lambda r: cell(r["long_arrivals"]["throughput_tok_s"], "{:.1f}")),
            ("KV moved (MB) / pull time (s)", lambda r: _transfer_cell(r["long_arrivals"]["transfer"])),
            ("short, low load: TTFT p50 (ms)", lambda r: cell(r["short_low_load"]["ttft_p50_ms"])),
            ("short, low load: TPOT p50 (ms)", lambda r: cell(r["short_low_load"]["tpot_p50_ms"])),
            ("short, low load: E2E p50 (s)", lambda r: cell(r["short_low_load"]["e2e_p50_s"], "{:.2f}"))]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(get(results[n]) for n in names) + " |" for label, get in rows]
    return "\n".join(lines)


def _transfer_cell(transfer: dict) -> str:
    if not transfer.get("pulls"):
        return "—"
    mb, seconds = transfer["bytes"] / 1e6, transfer["seconds"]
    return f"{mb:.1f} / {seconds:.2f} ({mb / 1e3 / max(seconds, 1e-9):.2f} GB/s)"


def same_answers(results: dict[str, dict]) -> dict[str, bool]:
    """Per layout: whether every answer equals the first layout's."""
    names = list(results)
    first = results[names[0]]
    texts = lambda r: r["long_arrivals"]["texts"] + r["short_low_load"]["texts"]  # noqa: E731
    prefix = lambda a, b: a.startswith(b) or b.startswith(a)  # noqa: E731 - streams stopped mid-answer
    return {name: texts(results[name]) == texts(first) and all(
        prefix(a, b) for a, b in zip(results[name]["long_arrivals"]["stream_texts"],
                                     first["long_arrivals"]["stream_texts"])) for name in names}
