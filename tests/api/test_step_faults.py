"""A step that fails inside the engine fails the requests it ran (a 500 error body, or an SSE error
event) and the server serves on; only failures in a row mean the engine is gone."""

from __future__ import annotations

import json

import httpx

from specdec.api.engine_loop import MAX_STEP_FAILURES

from .conftest import MODEL, chat_body, kv_used, metric, wait_until
from .test_sse import sse_events


class FlakyForward:
    """Replaces a runner's `forward`; `fail_in(n)` makes the n-th call from now raise,
    `always=True` every call."""

    def __init__(self, runner, always: bool = False) -> None:
        self.forward, self.always, self.countdown = runner.forward, always, 0
        runner.forward = self

    def fail_in(self, n: int) -> None:
        self.countdown = n

    def __call__(self, *args, **kwargs):
        self.countdown -= 1
        if self.always or self.countdown == 0:
            raise RuntimeError("simulated device failure")
        return self.forward(*args, **kwargs)


def test_a_failed_step_fails_its_requests_and_the_server_serves_on(serve, make_engine):
    engine = make_engine()
    flaky = FlakyForward(engine.target)
    with serve(engine) as srv:
        flaky.fail_in(3)
        plain = httpx.post(srv.url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True})
        error = plain.json()["error"]
        assert plain.status_code == 500 and error["type"] == "server_error" and error["code"] == "engine_error"
        assert "simulated device failure" in error["message"]

        flaky.fail_in(4)
        response, events = sse_events(srv, "/v1/chat/completions",
                                      chat_body(max_tokens=40, temperature=0, ignore_eos=True, stream=True))
        assert response.status_code == 200
        assert [name for name, _ in events][-2:] == ["error", None] and events[-1][1] == "[DONE]"
        assert "simulated device failure" in json.loads(events[-2][1])["error"]["message"]

        ok = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=6, ignore_eos=True), timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        assert httpx.get(srv.url + "/health").status_code == 200
        assert wait_until(lambda: kv_used(srv) == {"target": 0, "draft": 0})
        assert metric(srv, 'specdec_requests_total{outcome="error"}') == 2
        assert srv.app.state.specdec.limiter.active == 0


def test_failures_in_a_row_mean_the_engine_is_gone(serve, make_engine):
    engine = make_engine()
    FlakyForward(engine.target, always=True)
    with serve(engine) as srv:
        for _ in range(MAX_STEP_FAILURES):
            response = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=30)
            assert response.status_code == 500
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503)
        later = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=4))
        assert later.status_code == 503


def test_a_lost_rank_means_the_engine_is_gone_at_once(serve, make_engine):
    from specdec.parallel.comm import RankFailure

    engine = make_engine()

    def lost(*args, **kwargs):
        raise RankFailure("tensor-parallel group of 2: a rank's process ended; rank 1 exited with code -9")

    engine.target.forward = lost  # what a parallel target's runner raises when a rank is gone
    with serve(engine) as srv:
        response = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=30)
        assert response.status_code in (500, 503) and "rank 1" in response.text
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503)
