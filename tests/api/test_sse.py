"""SSE framing and the exact chunk sequence: role, content deltas (with the `specdec` extension),
finish_reason, usage, [DONE]; and an engine failure mid-stream becomes an error event."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import MODEL, chat_body, metric, wait_until

ORIGINS = {"accepted", "recovered", "bonus", "target"}


def sse_events(srv, path: str, body: dict) -> tuple[httpx.Response, list[tuple[str | None, str]]]:
    """POST and split the raw stream into (event name, data) records, checking the framing."""
    with httpx.stream("POST", srv.url + path, json=body, timeout=30) as response:
        raw = response.read().decode()
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = []
    for block in raw.split("\n\n")[:-1]:
        lines = [line for line in block.split("\n") if not line.startswith(":")]  # pings are comments
        if not lines:
            continue
        name = lines[0][len("event: "):] if lines[0].startswith("event: ") else None
        data = [line for line in lines if line.startswith("data: ")]
        assert len(data) == 1 and len(lines) == (2 if name else 1), block
        events.append((name, data[0][len("data: "):]))
    return response, events


def test_chat_stream_chunk_sequence(server):
    body = chat_body("write quicksort", max_tokens=48, temperature=0, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True})
    response, events = sse_events(server, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-store"
    assert all(name is None for name, _ in events)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)

    role, *content, finish, usage = chunks
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 48
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 48
    assert all(c["usage"] is None for c in chunks[:-1]), "include_usage: usage is null until the last chunk"

    seen = set()
    for chunk in content:
        ext, delta = chunk["specdec"], chunk["choices"][0]["delta"]
        assert chunk["choices"][0]["finish_reason"] is None
        assert len(ext["origins"]) == len(ext["pieces"]) >= 1
        assert "".join(ext["pieces"]) == delta["content"]
        assert set(ext["origins"]) <= ORIGINS
        assert 0 <= ext["accepted"] <= ext["drafted"]
        assert ext["origins"].count("accepted") == ext["accepted"] or ext is content[-1]["specdec"]
        seen.update(ext["origins"])
    assert sum(len(c["specdec"]["origins"]) for c in content) == 48
    assert {"accepted", "recovered", "bonus"} <= seen, "the tiny pair shows every speculative origin"


def test_stream_without_usage_has_no_usage_chunk(server):
    body = chat_body(max_tokens=8, temperature=0, ignore_eos=True, stream=True)
    _, events = sse_events(server, "/v1/chat/completions", body)
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert events[-1][1] == "[DONE]"
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_stream_chunk_sequence(server):
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    _, events = sse_events(server, "/v1/completions", body)
    *content, finish, usage = [json.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in content)
    assert all(c["choices"][0]["text"] == "".join(c["specdec"]["pieces"]) for c in content)
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["text"] == ""
    assert usage["usage"]["completion_tokens"] == 12


class ExplodingEngine:
    """Delegates to a real engine, but its `step` raises after `after` steps."""

    def __init__(self, engine, after: int) -> None:
        self._engine, self._left = engine, after

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self._left -= 1
        if self._left < 0:
            raise RuntimeError("simulated device failure")
        return self._engine.step()


def test_engine_failure_mid_stream_is_an_error_event_and_health_turns_503(serve, make_engine):
    with serve(ExplodingEngine(make_engine(), after=3)) as srv:
        body = chat_body(max_tokens=200, temperature=0, ignore_eos=True, stream=True)
        response, events = sse_events(srv, "/v1/chat/completions", body)
        assert response.status_code == 200
        names = [name for name, _ in events]
        assert names[-2:] == ["error", None] and events[-1][1] == "[DONE]"
        error = json.loads(events[-2][1])["error"]
        assert "simulated device failure" in error["message"] and error["type"] == "server_error"
        assert any("specdec" in json.loads(data) for _, data in events[:-2]), "tokens streamed before the failure"

        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "simulated device failure" in health.json()["error"]
        later = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=4))
        assert later.status_code == 503 and later.json()["error"]["type"] == "service_unavailable"
        assert metric(srv, "specdec_engine_up") == 0
        assert metric(srv, 'specdec_requests_total{outcome="error"}') == 1
        assert metric(srv, 'specdec_requests_total{outcome="unavailable"}') == 1


def test_engine_failure_fails_a_waiting_non_streaming_request(serve, make_engine):
    with serve(ExplodingEngine(make_engine(), after=2)) as srv:
        response = httpx.post(srv.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "x", "max_tokens": 100, "ignore_eos": True})
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
        assert "simulated device failure" in response.json()["error"]["message"]
        assert wait_until(lambda: srv.engine.error is not None)
        assert metric(srv, 'specdec_requests_total{outcome="error"}') == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_non_streaming_body_shape(server, path):
    body = chat_body(max_tokens=5, temperature=0) if "chat" in path else {
        "model": MODEL, "prompt": "hi", "max_tokens": 5, "temperature": 0}
    out = httpx.post(server.url + path, json=body, timeout=30).json()
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "specdec"}
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    assert set(out["specdec"]) == {"drafted", "accepted", "acceptance_rate"}


class RefusingEngine(ExplodingEngine):
    """Refuses every request in `add_request`, as the engine does for requests it can never run."""

    def add_request(self, *args, **kwargs):
        raise ValueError("refused by the engine")


def test_request_refused_by_the_engine_is_a_client_error_and_the_engine_lives_on(serve, make_engine):
    with serve(RefusingEngine(make_engine(), after=10**9)) as srv:
        plain = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=30)
        error = plain.json()["error"]
        assert plain.status_code == 400 and error["message"] == "refused by the engine"
        _, events = sse_events(srv, "/v1/chat/completions", chat_body(max_tokens=4, stream=True))
        assert [name for name, _ in events][-2:] == ["error", None] and events[-1][1] == "[DONE]"
        assert json.loads(events[-2][1])["error"]["type"] == "invalid_request_error"
        assert httpx.get(srv.url + "/health").status_code == 200
        assert srv.app.state.specdec.limiter.active == 0
