"""Clients that vanish mid-stream free their KV blocks at once; over --max-concurrent the server
answers 429 immediately while every admitted request completes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from .conftest import MODEL, chat_body, kv_used, metric, wait_until

STORM = 36  # streaming requests cut off mid-stream
STORM_NON_STREAMING = 6  # non-streaming requests whose client times out


async def _cut_stream(client: httpx.AsyncClient, i: int) -> int:
    """Start a long stream, read `i % 4` events, then drop the connection."""
    body = chat_body(f"story {i}", max_tokens=400, temperature=0.8, seed=i, ignore_eos=True, stream=True)
    events = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if events > i % 4:
                    break
    return events


async def _timed_out(client: httpx.AsyncClient, i: int) -> None:
    body = {"model": MODEL, "prompt": f"essay {i}", "max_tokens": 400, "ignore_eos": True}
    try:
        await client.post("/v1/completions", json=body, timeout=0.05 + 0.05 * i)
    except httpx.TimeoutException:
        pass


async def _storm(url: str) -> None:
    limits = httpx.Limits(max_connections=STORM + STORM_NON_STREAMING)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        await asyncio.gather(
            *(_cut_stream(client, i) for i in range(STORM)),
            *(_timed_out(client, i) for i in range(STORM_NON_STREAMING)),
        )


def test_disconnect_storm_frees_both_pools(serve, make_engine, record_property):
    with serve(make_engine(num_blocks=256, block_size=8, max_num_seqs=16)) as srv:
        asyncio.run(_storm(srv.url))
        cut_at = time.perf_counter()
        state = srv.app.state.specdec
        freed = wait_until(lambda: kv_used(srv) == {"target": 0, "draft": 0}, timeout=10)
        free_s = time.perf_counter() - cut_at
        record_property("pools_free_after_s", round(free_s, 3))
        assert freed, f"blocks still in use after the storm: {kv_used(srv)}"
        assert free_s < 3.0
        assert wait_until(lambda: state.limiter.active == 0 and state.engine.snapshot.num_running == 0)
        assert state.engine.queue_depth == 0

        started = time.perf_counter()
        body = chat_body(max_tokens=16, temperature=0, ignore_eos=True)
        after = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=10)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 16
        assert time.perf_counter() - started < 3.0
        cut = STORM + STORM_NON_STREAMING
        assert metric(srv, 'specdec_requests_total{outcome="aborted"}') == cut, "every request was cut mid-way"
        assert metric(srv, 'specdec_requests_total{outcome="length"}') == 1, "only the request after the storm ran out"
        print(f"disconnect storm: {cut} requests cut; both pools free {free_s * 1000:.0f} ms later")
        assert srv.engine.error is None


class SlowEngine:
    """A real engine whose steps take at least `delay` seconds, so requests stay in flight."""

    def __init__(self, engine, delay: float) -> None:
        self._engine, self._delay = engine, delay

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(self._delay)
        return self._engine.step()


def test_overload_answers_429_at_once_and_admitted_requests_complete(serve, make_engine):
    limit = 3
    with serve(SlowEngine(make_engine(), 0.01), max_concurrent=limit) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            body = chat_body(max_tokens=120, temperature=0, ignore_eos=True, stream=True,
                             stream_options={"include_usage": True})
            streams = [client.stream("POST", "/v1/chat/completions", json=body) for _ in range(limit)]
            responses = [s.__enter__() for s in streams]
            lines = [r.iter_lines() for r in responses]
            for it in lines:  # the role chunk: each request is admitted and running
                assert next(it).startswith("data: ")

            for extra in range(6):
                path = "/v1/chat/completions" if extra % 2 else "/v1/completions"
                payload = chat_body(max_tokens=4, stream=bool(extra % 3)) if extra % 2 else {
                    "model": MODEL, "prompt": "hi", "max_tokens": 4}
                started = time.perf_counter()
                rejected = client.post(path, json=payload)
                assert time.perf_counter() - started < 0.5, "429 comes at once, without queueing"
                assert rejected.status_code == 429
                assert rejected.json()["error"]["type"] == "rate_limit_error"
                assert rejected.headers["retry-after"] == "1"

            for it, stream in zip(lines, streams):
                data = [line[len("data: "):] for line in it if line.startswith("data: ")]
                stream.__exit__(None, None, None)
                assert data[-1] == "[DONE]"
                assert json.loads(data[-2])["usage"]["completion_tokens"] == 120

            again = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            assert again.status_code == 200, "slots are released when streams end"
        assert metric(srv, 'specdec_requests_total{outcome="rejected"}') == 6
        assert metric(srv, 'specdec_requests_total{outcome="length"}') == limit + 1
