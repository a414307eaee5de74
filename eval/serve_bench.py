"""`specdec bench serve`: load test a running OpenAI-compatible server the way vLLM does.

Method of vLLM's `benchmark_serving.py`: ShareGPT requests sampled and filtered by
`datasets.sample_sharegpt`, sent with `stream=true` at Poisson arrivals (gamma-distributed gaps
with shape `burstiness`, mean 1 / rate; `inf` sends all at once), optionally capped in flight.
Per request: TTFT (first chunk with text), ITL (gaps between text chunks), E2E (last chunk) and
TPOT = (E2E - TTFT) / (output tokens - 1), output tokens from the server's `usage` or, without it,
by tokenizing the streamed text; then throughput and goodput under SLOs (see `metrics`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specdec.eval import metrics, report
from specdec.eval.datasets import SampledRequest, sample_sharegpt
from specdec.eval.metrics import RequestTrace


@dataclass
class ServeBenchOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
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

    def __post_init__(self) -> None:
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError(f"--request-rates must be positive (inf allowed), got {self.request_rates}")
        if self.burstiness <= 0:
            raise ValueError("--burstiness must be positive")
        if self.limit is None or self.limit < 1:
            raise ValueError("--limit (the number of requests) must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be positive")

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
    import httpx

    trace = RequestTrace(time.perf_counter(), prompt_tokens=request.prompt_len)
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
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
                if usage := chunk.get("usage"):
                    trace.output_tokens = usage.get("completion_tokens")
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as error:
        trace.success, trace.error = False, f"{type(error).__name__}: {error}"
    if trace.success and not trace.chunk_times:
        trace.success, trace.error = False, "the stream carried no text"
    if trace.success and trace.output_tokens is None:
        trace.output_tokens = count_tokens("".join(text))
    return trace


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

    from specdec.target.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(spec))


def benchmark(opts: ServeBenchOptions) -> dict:
    """Sample the requests, then run every rate against the server."""
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
