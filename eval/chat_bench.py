"""`specdec bench chat`: the chat-latency scenario against a running OpenAI-compatible server.

Two measurements, each the way a chat user meets it:

1. **Turns.** Turn 1 pastes ~4,500 characters of Python source (the start of the standard
   library's `textwrap.py`, the same on every machine with the same Python) and asks a question;
   turn 2 resends that history with the streamed answer and a short follow-up, as every OpenAI
   client does. Reported: each turn's time to first token (TTFT) and the cached prompt tokens
   the server reports (`usage.prompt_tokens_details.cached_tokens`).
2. **Interference.** A stream runs; once it has sent `--warmup-chunks` chunks, a second request
   with a long prompt (the same source, so ~1.3k tokens) arrives. Reported: the running stream's
   median gap between chunks before the arrival, its worst gap from the arrival until the long
   request's first token, their ratio, and the long request's TTFT.

Every run salts its requests (`cache_salt`, one salt per conversation), so nothing cached by an
earlier run is reused: turn 1 and the long prompt are always computed in full.
"""

from __future__ import annotations

import asyncio
import inspect
import statistics
import textwrap
import time
import uuid
from dataclasses import asdict, dataclass

from specdec.eval.metrics import RequestTrace
from specdec.eval.serve_bench import stream_request

SOURCE_CHARS = 4500
QUESTION = "What does this module do? Name its three most important functions."
FOLLOW_UP = "Show a short example that uses the second one."
STREAM_PROMPT = "Write a long, detailed tutorial on Python generators with many examples."


@dataclass
class ChatBenchOptions:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    max_tokens: int = 64  # answer length per turn
    stream_tokens: int = 4000  # the running stream's cap (it is cancelled once measured)
    warmup_chunks: int = 8
    timeout: float = 900.0
    source_chars: int = SOURCE_CHARS  # the paste's length (tests use a short one)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.stream_tokens < 1:
            raise ValueError("--max-tokens and --stream-tokens must be positive")
        if self.warmup_chunks < 2:
            raise ValueError("--warmup-chunks must be at least 2 (a median gap needs two chunks)")


def pasted_source(num_chars: int = SOURCE_CHARS) -> str:
    """The turn-1 paste: the first `num_chars` characters of `textwrap.py`."""
    return inspect.getsource(textwrap)[:num_chars]


def first_turn(num_chars: int = SOURCE_CHARS) -> list[dict]:
    return [{"role": "user", "content": f"{pasted_source(num_chars)}\n\n{QUESTION}"}]


def _body(opts: ChatBenchOptions, model: str, messages: list[dict], max_tokens: int, salt: str) -> dict:
    return {
        "model": model, "messages": messages, "stream": True, "temperature": 0,
        "max_tokens": max_tokens, "stream_options": {"include_usage": True}, "cache_salt": salt,
    }


async def _chat(client, opts, model, messages, max_tokens, salt) -> tuple[RequestTrace, str]:
    trace = RequestTrace(time.perf_counter())
    text, usage = await stream_request(client, "/v1/chat/completions", _body(opts, model, messages, max_tokens, salt), trace)
    if not trace.success:
        raise RuntimeError(f"request failed: {trace.error}")
    trace.prompt_tokens = (usage or {}).get("prompt_tokens", 0)
    return trace, text


async def run_turns(client, opts: ChatBenchOptions, model: str) -> dict:
    """Turn 1 and turn 2 of one conversation; TTFT and cached prompt tokens of each."""
    salt = uuid.uuid4().hex
    first, answer = await _chat(client, opts, model, first_turn(opts.source_chars), opts.max_tokens, salt)
    history = first_turn(opts.source_chars) + [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    second, _ = await _chat(client, opts, model, history, opts.max_tokens, salt)
    turns = [
        {"ttft_s": t.chunk_times[0] - t.start, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens}
        for t in (first, second)
    ]
    return {"turn1": turns[0], "turn2": turns[1], "ttft_ratio": turns[0]["ttft_s"] / turns[1]["ttft_s"]}


async def run_interference(client, opts: ChatBenchOptions, model: str) -> dict:
    """A running stream's gaps before and while a long prompt arrives; that prompt's TTFT."""
    stream_trace = RequestTrace(time.perf_counter())
    stream_messages = [{"role": "user", "content": STREAM_PROMPT}]
    body = _body(opts, model, stream_messages, opts.stream_tokens, uuid.uuid4().hex)
    body["ignore_eos"] = True
    stream = asyncio.create_task(stream_request(client, "/v1/chat/completions", body, stream_trace))
    while len(stream_trace.chunk_times) < opts.warmup_chunks:
        if stream.done():
            raise RuntimeError(f"the stream ended before {opts.warmup_chunks} chunks: {stream_trace.error}")
        await asyncio.sleep(0.01)
    arrival = time.perf_counter()
    long_trace, _ = await _chat(client, opts, model, first_turn(opts.source_chars), 1, uuid.uuid4().hex)
    first_token = long_trace.chunk_times[0]
    while not stream.done() and stream_trace.chunk_times[-1] <= first_token:
        await asyncio.sleep(0.01)  # the gap that spans the first token must close
    stream.cancel()  # disconnecting aborts the rest of the stream on the server
    await asyncio.gather(stream, return_exceptions=True)
    times = stream_trace.chunk_times
    before = [b - a for a, b in zip(times, times[1:]) if b <= arrival]
    # gaps that overlap [arrival, first token of the long request]
    during = [b - a for a, b in zip(times, times[1:]) if b > arrival and a < first_token]
    if not before or not during or times[-1] < first_token:
        raise RuntimeError("the stream ended before the long prompt's first token: raise --stream-tokens")
    if not stream_trace.success and "Cancelled" not in stream_trace.error:
        raise RuntimeError(f"the stream failed: {stream_trace.error}")
    median = statistics.median(before)
    return {
        "median_gap_before_s": median, "worst_gap_during_s": max(during),
        "gap_ratio": max(during) / median, "long_prompt_ttft_s": first_token - arrival,
        "long_prompt_tokens": long_trace.prompt_tokens,
    }


async def run_chat_bench(opts: ChatBenchOptions) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=opts.base_url, timeout=opts.timeout, trust_env=False) as client:
        model = opts.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        turns = await run_turns(client, opts, model)
        interference = await run_interference(client, opts, model)
    return {"options": asdict(opts), "turns": turns, "interference": interference}


def markdown(result: dict) -> str:
    t, i = result["turns"], result["interference"]
    lines = [
        "| measurement | value |", "|---|---|",
        f"| turn 1 TTFT ({t['turn1']['prompt_tokens']} prompt tokens, {t['turn1']['cached_tokens']} cached) "
        f"| {t['turn1']['ttft_s']:.2f} s |",
        f"| turn 2 TTFT ({t['turn2']['prompt_tokens']} prompt tokens, {t['turn2']['cached_tokens']} cached) "
        f"| {t['turn2']['ttft_s']:.2f} s |",
        f"| turn 1 / turn 2 TTFT | {t['ttft_ratio']:.1f}x |",
        f"| running stream: median gap before the long prompt | {i['median_gap_before_s'] * 1000:.0f} ms |",
        f"| running stream: worst gap until the long prompt's first token | {i['worst_gap_during_s'] * 1000:.0f} ms "
        f"({i['gap_ratio']:.1f}x the median) |",
        f"| long prompt ({i['long_prompt_tokens']} tokens) TTFT under that load | {i['long_prompt_ttft_s']:.2f} s |",
    ]
    return "\n".join(lines)
