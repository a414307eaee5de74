"""`specdec bench serve`: load test a running OpenAI-compatible server the way vLLM does.

Method of vLLM's `benchmark_serving.py`: ShareGPT requests sampled and filtered by
`datasets.sample_sharegpt`, sent with `stream=true` at Poisson arrivals (gamma-distributed gaps
with shape `burstiness`, mean 1 / rate; `inf` sends all at once), optionally capped in flight.
Per request: TTFT (first chunk with text), ITL (gaps between text chunks), E2E (last chunk) and
TPOT = (E2E - TTFT) / (output tokens - 1), output tokens from the server's `usage` or, without it,
by tokenizing the streamed text; then throughput and goodput under SLOs (see `metrics`).

`--multi-turn` replays ShareGPT conversations (`datasets.sample_sharegpt_conversations`) against
/v1/chat/completions the way a chat client does: conversations start at the same Poisson arrivals,
their turns go one after another, and each turn resends the whole history with the answer the
server actually streamed for the turn before. Every rate runs two passes over the same
conversations in the same order: `cache` (plain requests, so turns reuse the KV of the history
through the server's prefix cache) and `no-cache` (a fresh random `cache_salt` on every request, so
nothing is reused). Per turn: TTFT, ITL, TPOT, E2E, prompt and cached tokens (from the usage
chunk); reported for first and later turns, with the prefix hit rate = cached / prompt tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specdec.api.cluster.routing import POLICIES, ROUTER_HEADER
from specdec.eval import metrics, report
from specdec.eval.datasets import Conversation, SampledRequest, sample_sharegpt, sample_sharegpt_conversations
from specdec.eval.metrics import RequestTrace

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass
class ServeBenchOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None  # default: /v1/completions, or the chat endpoint with multi_turn
    model: str | None = None
    dataset_path: Path | None = None
    tokenizer: str = "default-target"
    request_rates: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.5])
    burstiness: float = 1.0
    max_concurrency: int | None = None
    output_len: int | None = None
    max_prompt_len: int = 1024
    temperature: float = 0.0
    ignore_eos: bool = False
    slos: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [50, 90, 99])
    timeout: float = 600.0
    limit: int | None = 50
    seed: int = 0
    progress: bool = True
    multi_turn: bool = False
    max_turns: int = 3
    # --multi-turn against `specdec serve --replicas N`: one cached pass per router policy, each sent
    # with the `x-specdec-router` header, instead of the with / without caching pair
    routers: list[str] | None = None
    min_turns: int = 2  # --multi-turn: keep only conversations with this many turns or more

    def __post_init__(self) -> None:
        if self.endpoint is None:
            self.endpoint = CHAT_ENDPOINT if self.multi_turn else "/v1/completions"
        if self.multi_turn and not self.chat:
            raise ValueError(f"--multi-turn sends chat requests to {CHAT_ENDPOINT}; drop --endpoint {self.endpoint}")
        if self.max_turns < 2:
            raise ValueError(f"--max-turns must be at least 2 (a multi-turn conversation), got {self.max_turns}")
        if not 2 <= self.min_turns <= self.max_turns:
            raise ValueError(f"--min-turns must be in [2, --max-turns], got {self.min_turns}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"--output-len must be positive, got {self.output_len}")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError(f"--request-rates must be positive (inf allowed), got {self.request_rates}")
        if self.burstiness <= 0:
            raise ValueError("--burstiness must be positive")
        if self.limit is None or self.limit < 1:
            raise ValueError("--limit (the number of requests) must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be positive")
        if self.routers is not None:
            if not self.multi_turn:
                raise ValueError("--routers compares routers on multi-turn chat: add --multi-turn")
            unknown = [r for r in self.routers if r not in POLICIES]
            if unknown or not self.routers or len(set(self.routers)) != len(self.routers):
                raise ValueError(f"--routers takes distinct names among {', '.join(POLICIES)}, got {self.routers}")

    @property
    def passes(self) -> tuple[str, ...]:
        """The passes run at every rate, in this order."""
        return PASSES if self.routers is None else tuple(ROUTER_PASS + r for r in self.routers)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times (s after start) of n requests: the first at 0, then gamma gaps of mean 1 / rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def payload(
    opts: ServeBenchOptions, model: str, request: SampledRequest, max_tokens: int | None = None
) -> dict:
    """The OpenAI request body: greedy by default, streamed, with usage in the last chunk."""
    body: dict = {
        "model": model, "max_tokens": max_tokens or request.output_len, "temperature": opts.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if opts.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict) -> str:
    """The text of one SSE chunk: `choices[0].text` (completions) or `.delta.content` (chat)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(client, url: str, body: dict, request: SampledRequest, count_tokens) -> RequestTrace:
    """Stream one request; the trace stamps every chunk that brings text."""
    trace = RequestTrace(time.perf_counter(), prompt_tokens=request.prompt_len)
    text, _ = await stream_request(client, url, body, trace)
    if trace.success and trace.output_tokens is None:
        trace.output_tokens = count_tokens(text)
    return trace


async def stream_request(client, url: str, body: dict, trace: RequestTrace,
                         headers: dict | None = None) -> tuple[str, dict | None]:
    """Stream one request into `trace` (a stamp per chunk that brings text; output and cached tokens
    from the usage chunk); returns the streamed text and the server's `usage` (None without one).
    A failure marks the trace instead of raising."""
    import httpx

    text: list[str] = []
    usage: dict | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if piece := chunk_text(chunk):
                    trace.add_chunk(time.perf_counter(), 0)
                    text.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as error:
        trace.success, trace.error = False, f"{type(error).__name__}: {error}"
    if trace.success and not trace.chunk_times:
        trace.success, trace.error = False, "the stream carried no text"
    if usage:
        trace.output_tokens = usage.get("completion_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        trace.cached_tokens = cached if isinstance(cached, int) else None
    return "".join(text), usage


async def run_rate(client, opts: ServeBenchOptions, model: str, requests: list[SampledRequest], rate: float,
                   count_tokens, bar) -> dict:
    """All requests at one arrival rate; vLLM's metrics over the run."""
    offsets = arrival_offsets(len(requests), rate, opts.burstiness, np.random.default_rng(opts.seed))
    limit = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    start = time.perf_counter()

    async def one(request: SampledRequest, offset: float) -> RequestTrace:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        body = payload(opts, model, request)
        if limit is None:
            trace = await send_request(client, opts.endpoint, body, request, count_tokens)
        else:
            async with limit:
                trace = await send_request(client, opts.endpoint, body, request, count_tokens)
        bar.update(1)
        return trace

    traces = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    duration = time.perf_counter() - start
    result = metrics.serving_metrics(traces, duration, opts.slos, opts.percentiles)
    errors = sorted({t.error for t in traces if not t.success})
    return {"request_rate": rate, **result, "errors": errors[:5]}


async def _server_model(client, opts: ServeBenchOptions) -> str:
    """The model name to send: --model, else the server's first listed model."""
    import httpx

    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as error:
        raise ValueError(
            f"no server answers at {opts.base_url} ({error}); start one with `specdec serve`"
        ) from None
    if opts.model:
        return opts.model
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "specdec"


async def run_all(opts: ServeBenchOptions, requests: list[SampledRequest], count_tokens) -> dict:
    import httpx
    from tqdm.auto import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(base_url=opts.base_url, timeout=opts.timeout, limits=limits, trust_env=False)
    async with client:
        model = await _server_model(client, opts)
        probe = payload(opts, model, requests[0], max_tokens=4)
        check = await send_request(client, opts.endpoint, probe, requests[0], count_tokens)
        if not check.success:
            raise ValueError(f"the test request to {opts.base_url}{opts.endpoint} failed: {check.error}")
        runs = []
        with tqdm(total=len(requests) * len(opts.request_rates), desc="bench serve", unit="req",
                  disable=not opts.progress) as bar:
            for rate in opts.request_rates:
                bar.set_postfix_str(f"rate {rate}/s")
                runs.append(await run_rate(client, opts, model, requests, rate, count_tokens, bar))
    return {"model": model, "runs": runs}


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from specdec.target.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(spec))


def benchmark(opts: ServeBenchOptions) -> dict:
    """Sample the requests, then run every rate against the server."""
    if opts.multi_turn:
        return benchmark_multi_turn(opts)
    tokenizer = load_tokenizer(opts.tokenizer)
    requests = sample_sharegpt(
        lambda s: tokenizer(s).input_ids, opts.limit, opts.seed, opts.output_len, opts.max_prompt_len,
        path=opts.dataset_path,
    )
    if not requests:
        raise ValueError("no ShareGPT request passes the filters; raise --max-prompt-len")
    count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    result = asyncio.run(run_all(opts, requests, count_tokens))
    result["requests"] = [asdict(r) | {"prompt": r.prompt[:80]} for r in requests]
    return result


# ---- report ----------------------------------------------------------------------------------


def table(result: dict) -> str:
    if result.get("multi_turn"):
        return multi_turn_table(result)
    headers = ["rate req/s", "completed", "failed", "duration s", "req/s", "goodput req/s", "output tok/s",
               "total tok/s"]
    rows = [[r["request_rate"], r["completed"], r["failed"], r["duration_s"], r["request_throughput"],
             r["request_goodput"], r["output_throughput"], r["total_token_throughput"]] for r in result["runs"]]
    return report.markdown_table(headers, rows)


def latency_table(result: dict, percentiles: list[float]) -> str:
    keys = ["mean", *[metrics.percentile_key(p) for p in percentiles]]
    headers = ["rate req/s", "metric (ms)", *keys]
    rows = []
    for r in result["runs"]:
        for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
            rows.append([r["request_rate"], label, *[r[name].get(k) for k in keys]])
    return report.markdown_table(headers, rows)


def plot(result: dict, path: Path) -> Path:
    runs = result["runs"]
    labels = [f"{r['request_rate']:g}" for r in runs]
    fig, axes = report.new_figure(ncols=4, width=4.0)
    for ax, (name, title) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E latency"))):
        for key in ("p50", "p99"):
            ax.plot(labels, [r[name].get(key) or 0.0 for r in runs], marker="o", label=key)
        ax.set(title=title, xlabel="request rate (req/s)", ylabel="ms")
        ax.legend()
    ax = axes[3]
    ax.plot(labels, [r["request_throughput"] for r in runs], marker="o", label="requests/s")
    if any(r["request_goodput"] is not None for r in runs):
        ax.plot(labels, [r["request_goodput"] or 0.0 for r in runs], marker="o", label="goodput")
    ax.set(title="throughput", xlabel="request rate (req/s)", ylabel="requests/s")
    ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    return report.save_figure(fig, path)


def write_report(out: Path, meta: dict, opts: ServeBenchOptions, result: dict) -> list[Path]:
    if opts.multi_turn:
        return write_multi_turn_report(out, meta, opts, result)
    payload_ = {"meta": meta, "options": asdict(opts), "results": result}
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in opts.slos.items()) or "none given"
    files = [report.write_json(out / "serve.json", payload_)]
    files.append(report.write_markdown(out / "serve.md", "Serving benchmark", meta, [
        ("Throughput", table(result) + f"\n\n{len(result['requests'])} ShareGPT requests per rate against "
         f"{opts.base_url}{opts.endpoint} (model {result['model']}). Goodput SLOs: {slos}."),
        ("Latency", latency_table(result, opts.percentiles)),
    ]))
    files.append(plot(result, out / "serve.png"))
    return files


# ---- multi-turn chat (--multi-turn) ------------------------------------------------------------

PASSES = ("cache", "no-cache")  # run in this order at every rate; "no-cache" salts every request
PASS_LABELS = {"cache": "with caching", "no-cache": "without caching"}
# With --routers: one cached pass per router policy of `specdec serve --replicas` (specdec.api.cluster)
ROUTER_PASS = "router:"


def pass_label(name: str) -> str:
    if name.startswith(ROUTER_PASS):
        router = name[len(ROUTER_PASS):]
        return "one replica" if router == "one" else f"{router} router"
    return PASS_LABELS[name]


def pass_headers(name: str) -> dict | None:
    return {ROUTER_HEADER: name[len(ROUTER_PASS):]} if name.startswith(ROUTER_PASS) else None
_TABLE_PERCENTILES = (50.0, 99.0)


@dataclass
class TurnTrace:
    """One turn of one conversation in one pass (turns count from 1)."""

    conversation: int  # index in the sampled list (ShareGPT ids may repeat)
    conversation_id: str
    turn: int
    trace: RequestTrace

    def record(self) -> dict:
        """What serve.json keeps of the turn: latencies (ms) and token counts."""
        t = self.trace
        done = t.success and bool(t.chunk_times)
        return {
            "conversation": self.conversation, "id": self.conversation_id, "turn": self.turn,
            "success": t.success, "error": t.error, "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens, "output_tokens": t.num_output_tokens if done else None,
            "ttft_ms": 1000.0 * t.ttft if done else None,
            "tpot_ms": 1000.0 * t.tpot if done and t.tpot is not None else None,
            "e2el_ms": 1000.0 * t.e2e if done else None,
            "itl_ms": [1000.0 * g for g in t.itl] if done else [],
        }


def chat_payload(
    opts: ServeBenchOptions, model: str, messages: list[dict], max_tokens: int, cache_salt: str | None
) -> dict:
    """A streamed chat request with usage in the last chunk; `cache_salt` only when given."""
    body: dict = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": opts.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def fresh_salt() -> str:
    """A random `cache_salt` no other request uses: its request shares no cached prefix."""
    return secrets.token_hex(16)


async def run_conversation(
    client, opts: ServeBenchOptions, model: str, index: int, conversation: Conversation, salted: bool,
    count_tokens, bar, pass_salt: str | None = None, headers: dict | None = None,
) -> list[TurnTrace]:
    """Send a conversation's turns in order, each with the whole history so far: every earlier
    message and the answer the server streamed for it. After a failed turn the rest are failed
    too (their history would lack an answer)."""
    messages: list[dict] = []
    turns: list[TurnTrace] = []
    for number, turn in enumerate(conversation.turns, 1):
        if turns and not turns[-1].trace.success:
            skipped = RequestTrace(time.perf_counter(), success=False, error="an earlier turn failed")
            turns.append(TurnTrace(index, conversation.id, number, skipped))
            bar.update(1)
            continue
        messages.append({"role": "user", "content": turn.prompt})
        body = chat_payload(opts, model, list(messages), turn.output_len, fresh_salt() if salted else pass_salt)
        trace = RequestTrace(time.perf_counter())
        answer, usage = await stream_request(client, opts.endpoint, body, trace, headers)
        prompt_tokens = (usage or {}).get("prompt_tokens")
        trace.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else sum(
            count_tokens(m["content"]) for m in messages)
        if trace.success and trace.output_tokens is None:
            trace.output_tokens = count_tokens(answer)
        messages.append({"role": "assistant", "content": answer})
        turns.append(TurnTrace(index, conversation.id, number, trace))
        bar.update(1)
    return turns


async def run_pass(
    client, opts: ServeBenchOptions, model: str, conversations: list[Conversation], rate: float,
    salted: bool, count_tokens, bar, headers: dict | None = None,
) -> dict:
    """Every conversation once, starting at Poisson arrivals (the same offsets in every pass).
    Unsalted requests share one salt per pass: they reuse each other's prefixes but nothing an
    earlier pass or rate left in the cache."""
    pass_salt = fresh_salt()
    offsets = arrival_offsets(len(conversations), rate, opts.burstiness, np.random.default_rng(opts.seed))
    limit = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    start = time.perf_counter()

    async def one(index: int, conversation: Conversation, offset: float) -> list[TurnTrace]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        args = (client, opts, model, index, conversation, salted, count_tokens, bar, pass_salt, headers)
        if limit is None:
            return await run_conversation(*args)
        async with limit:
            return await run_conversation(*args)

    done = await asyncio.gather(*(one(i, c, o) for i, (c, o) in enumerate(zip(conversations, offsets))))
    duration = time.perf_counter() - start
    return pass_metrics([turn for turns in done for turn in turns], duration, opts)


def pass_metrics(turns: list[TurnTrace], duration: float, opts: ServeBenchOptions) -> dict:
    """vLLM's metrics over all turns, latency and prefix hits for first and later turns, per-turn records."""
    percentiles = sorted({*map(float, opts.percentiles), *_TABLE_PERCENTILES})
    traces = [t.trace for t in turns]
    by_turn = {}
    for name, group in (("first", [t.trace for t in turns if t.turn == 1]),
                        ("later", [t.trace for t in turns if t.turn > 1])):
        by_turn[name] = {
            "turns": len(group), "completed": sum(1 for t in group if t.success),
            **metrics.latency_distributions(group, percentiles), **metrics.prefix_cache_usage(group),
        }
    conversations = {t.conversation for t in turns}
    failed = {t.conversation for t in turns if not t.trace.success}
    return {
        **metrics.serving_metrics(traces, duration, opts.slos, percentiles),
        **metrics.prefix_cache_usage(traces),
        "conversations": len(conversations),
        "completed_conversations": len(conversations - failed),
        "by_turn": by_turn,
        "errors": sorted({t.error for t in traces if not t.success})[:5],
        "turn_records": [t.record() for t in turns],
    }


def pass_warnings(passes: dict[str, dict]) -> list[str]:
    """What makes a run's comparison doubtful: no cached-token counts, or hits despite salts."""
    warnings = []
    if all(p["prefix_hit_rate"] is None for p in passes.values()):
        warnings.append("the server reports no usage.prompt_tokens_details.cached_tokens: hit rates unknown")
    elif "no-cache" in passes and (passes["no-cache"]["cached_tokens"] or 0) > 0:
        warnings.append("salted requests found cached tokens: the server seems to ignore cache_salt, so "
                        "the 'without caching' pass is not cold")
    return warnings


async def run_multi_turn_all(opts: ServeBenchOptions, conversations: list[Conversation], count_tokens) -> dict:
    """At every rate: the cached pass, then the salted (uncached) pass, one after the other."""
    import httpx
    from tqdm.auto import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(base_url=opts.base_url, timeout=opts.timeout, limits=limits, trust_env=False)
    num_turns = sum(len(c.turns) for c in conversations)
    async with client:
        model = await _server_model(client, opts)
        first = [{"role": "user", "content": conversations[0].turns[0].prompt}]
        probe = RequestTrace(time.perf_counter())
        await stream_request(client, opts.endpoint, chat_payload(opts, model, first, 4, fresh_salt()), probe)
        if not probe.success:  # salted, so the probe leaves nothing the cached pass could reuse
            raise ValueError(f"the test request to {opts.base_url}{opts.endpoint} failed: {probe.error}")
        runs = []
        with tqdm(total=num_turns * len(opts.passes) * len(opts.request_rates), desc="bench serve multi-turn",
                  unit="turn", disable=not opts.progress) as bar:
            for rate in opts.request_rates:
                passes = {}
                for name in opts.passes:
                    bar.set_postfix_str(f"rate {rate}/s, {pass_label(name)}")
                    passes[name] = await run_pass(
                        client, opts, model, conversations, rate, name == "no-cache", count_tokens, bar,
                        pass_headers(name))
                warnings = pass_warnings(passes)
                runs.append({"request_rate": rate, "passes": passes, "warnings": warnings})
    return {"model": model, "multi_turn": True, "runs": runs}


def benchmark_multi_turn(opts: ServeBenchOptions) -> dict:
    """Sample the conversations, then run both passes at every rate against the server."""
    tokenizer = load_tokenizer(opts.tokenizer)
    tokenize = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    count_tokens = lambda text: len(tokenize(text))  # noqa: E731
    conversations = sample_sharegpt_conversations(
        tokenize, opts.limit, opts.seed, opts.output_len, opts.max_prompt_len, opts.max_turns,
        path=opts.dataset_path, min_turns=opts.min_turns,
    )
    if not conversations:
        raise ValueError("no ShareGPT conversation keeps two turns under the filters; raise --max-prompt-len "
                         "or lower --output-len")
    result = asyncio.run(run_multi_turn_all(opts, conversations, count_tokens))
    result["conversations"] = [
        {"id": c.id, "turns": [asdict(t) | {"prompt": t.prompt[:80]} for t in c.turns]} for c in conversations
    ]
    return result


def _ratio(with_cache: float | None, without: float | None) -> str | None:
    if with_cache is None or not without:
        return None
    return f"{with_cache / without:.2f}x"


def router_table(result: dict) -> str:
    """Side by side, per rate, one column per router: later-turn hit rate, TTFT p50 / p99 of first
    and later turns, throughput, completed turns; the prefix router's ratios to the others."""
    names = list(result["runs"][0]["passes"])
    others = [n for n in names if n != ROUTER_PASS + "prefix"]
    has_prefix = len(others) < len(names)
    headers = ["rate", "metric", "turns", *map(pass_label, names),
               *([f"prefix / {pass_label(n)}" for n in others] if has_prefix else [])]
    rows = []
    for run in result["runs"]:
        passes = run["passes"]

        def row(label: str, turns: str, values: list) -> None:
            base = dict(zip(names, values)).get(ROUTER_PASS + "prefix")
            ratios = [_ratio(base, dict(zip(names, values))[n]) for n in others] if has_prefix else []
            rows.append([run["request_rate"], label, turns, *values, *ratios])

        for turns in ("later", "first"):
            row("prefix hit rate", turns, [passes[n]["by_turn"][turns]["prefix_hit_rate"] for n in names])
        for p in _TABLE_PERCENTILES:
            key = metrics.percentile_key(p)
            for turns in ("later", "first"):
                row(f"TTFT {key} (ms)", turns, [passes[n]["by_turn"][turns]["ttft_ms"][key] for n in names])
        row("output tok/s", "all", [passes[n]["output_throughput"] for n in names])
        row("turns/s", "all", [passes[n]["request_throughput"] for n in names])
        rows.append([run["request_rate"], "completed turns", "all",
                     *[f"{passes[n]['completed']}/{passes[n]['completed'] + passes[n]['failed']}" for n in names],
                     *([None] * len(others) if has_prefix else [])])
    notes = [f"warning (rate {run['request_rate']}): {w}" for run in result["runs"] for w in run["warnings"]]
    return "\n\n".join([report.markdown_table(headers, rows), *notes])


def multi_turn_table(result: dict) -> str:
    """Side by side, per rate: TTFT / TPOT / ITL p50 and p99 and the prefix hit rate for first and
    later turns, with and without caching, and their ratio (or, with --routers, `router_table`)."""
    if "cache" not in result["runs"][0]["passes"]:
        return router_table(result)
    headers = ["rate", "metric", "turns", PASS_LABELS["cache"], PASS_LABELS["no-cache"], "with / without"]
    rows = []
    for run in result["runs"]:
        rate, cache, cold = run["request_rate"], run["passes"]["cache"], run["passes"]["no-cache"]
        for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
            for p in _TABLE_PERCENTILES:
                key = metrics.percentile_key(p)
                for turns in ("first", "later"):
                    a, b = cache["by_turn"][turns][name][key], cold["by_turn"][turns][name][key]
                    rows.append([rate, f"{label} {key} (ms)", turns, a, b, _ratio(a, b)])
        for turns in ("first", "later", "all"):
            a, b = ((cache, cold) if turns == "all" else (cache["by_turn"][turns], cold["by_turn"][turns]))
            rows.append([rate, "prefix hit rate", turns, a["prefix_hit_rate"], b["prefix_hit_rate"], None])
        rows.append([rate, "completed turns", "all", f"{cache['completed']}/{cache['completed'] + cache['failed']}",
                     f"{cold['completed']}/{cold['completed'] + cold['failed']}", None])
        rows.append([rate, "output tok/s", "all", cache["output_throughput"], cold["output_throughput"],
                     _ratio(cache["output_throughput"], cold["output_throughput"])])
    notes = [f"warning (rate {run['request_rate']}): {w}" for run in result["runs"] for w in run["warnings"]]
    return "\n\n".join([report.markdown_table(headers, rows), *notes])


def multi_turn_throughput_table(result: dict) -> str:
    headers = ["rate", "pass", "conversations done", "turns done", "failed", "duration s", "turns/s",
               "output tok/s", "prompt tok", "cached tok", "hit rate"]
    rows = []
    for run in result["runs"]:
        for name, p in run["passes"].items():
            rows.append([run["request_rate"], pass_label(name), f"{p['completed_conversations']}/{p['conversations']}",
                         p["completed"], p["failed"], p["duration_s"], p["request_throughput"],
                         p["output_throughput"], p["prompt_tokens"], p["cached_tokens"], p["prefix_hit_rate"]])
    return report.markdown_table(headers, rows)


def plot_multi_turn(result: dict, path: Path) -> Path:
    """p50 TTFT / TPOT / ITL of first and later turns, per pass (with and without caching, or per
    router), per rate."""
    fig, axes = report.new_figure(ncols=3, width=4.5)
    groups = [(run, turns) for run in result["runs"] for turns in ("first", "later")]
    labels = [f"{run['request_rate']:g}/s {turns}" for run, turns in groups]
    x = np.arange(len(groups))
    for ax, (name, title) in zip(axes, (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50"), ("itl_ms", "ITL p50"))):
        names = list(result["runs"][0]["passes"])
        width = 0.8 / len(names)
        for i, pass_name in enumerate(names):
            values = [run["passes"][pass_name]["by_turn"][turns][name]["p50"] or 0.0 for run, turns in groups]
            ax.bar(x + (i - (len(names) - 1) / 2) * width, values, width=width, label=pass_label(pass_name))
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set(title=title, ylabel="ms")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    return report.save_figure(fig, path)


def write_multi_turn_report(out: Path, meta: dict, opts: ServeBenchOptions, result: dict) -> list[Path]:
    payload_ = {"meta": meta, "options": asdict(opts), "results": result}
    conversations = result["conversations"]
    num_turns = sum(len(c["turns"]) for c in conversations)
    files = [report.write_json(out / "serve_multi_turn.json", payload_)]
    if opts.routers is not None:
        section = "Routers side by side"
        method = (
            ", once per router, each pass with its own cache salt (so none reuses another's blocks) and the "
            f"{ROUTER_HEADER} header naming the router; 'one replica' sends every request to the same replica, "
            "as one server would. Conversations start at Poisson arrivals of the given rate; their turns go one "
            "after another. Hit rate = cached / prompt tokens (from the usage chunk).")
    else:
        section = "With and without prefix caching"
        method = (
            "; conversations start at Poisson arrivals of the given rate, their turns go one after another, "
            "each resending the history with the streamed answers. 'Without caching' sends a fresh random "
            "cache_salt on every request; 'with caching' sends one salt shared by all its requests (a fresh one "
            "per pass, so it reuses nothing an earlier pass left) and runs first. Hit rate = cached / prompt "
            "tokens (from the usage chunk).")
    files.append(report.write_markdown(out / "serve_multi_turn.md", "Multi-turn serving benchmark", meta, [
        (section, multi_turn_table(result) + (
            f"\n\n{len(conversations)} ShareGPT conversations ({num_turns} turns, at most {opts.max_turns} each) "
            f"against {opts.base_url}{opts.endpoint} (model {result['model']})" + method)),
        ("Throughput", multi_turn_throughput_table(result)),
    ]))
    files.append(plot_multi_turn(result, out / "serve_multi_turn.png"))
    return files
