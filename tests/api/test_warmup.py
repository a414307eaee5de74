"""`/health` stays 503 ("warming up") until the warm-up has run, then the server serves warm with
nothing held and no warm-up counted in its metrics; a warm-up that fails is a load failure."""

import threading

import httpx
import pytest

import specdec.warmup
from tests.api.conftest import kv_used, metric


def chat(srv, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)


def test_health_reports_warming_up_until_the_warm_up_is_done(serve, make_engine, monkeypatch):
    gate, warmed = threading.Event(), []
    real = specdec.warmup.warm_up

    def slow_warm_up(engine):
        gate.wait(20)
        report = real(engine)
        warmed.append(report)
        return report

    monkeypatch.setattr(specdec.warmup, "warm_up", slow_warm_up)
    with serve(make_engine, wait=False, warmup=True) as srv:
        health = httpx.get(srv.url + "/health")
        while health.json()["status"] == "loading":
            health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "warming up"}
        gate.set()
        srv.wait_healthy()
        assert warmed and warmed[0].num_tokens > 0
        assert kv_used(srv) == {"target": 0, "draft": 0}
        assert metric(srv, 'specdec_prefix_cache_queried_tokens_total{pool="target"}') == 0
        assert metric(srv, "specdec_acceptance_rate") == 0
        out = chat(srv)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1


def test_a_failed_warm_up_is_a_load_failure(serve, make_engine, monkeypatch):
    def broken(engine):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(specdec.warmup, "warm_up", broken)
    failures = []
    with serve(make_engine, wait=False, warmup=True, on_load_error=failures.append) as srv:
        health = httpx.get(srv.url + "/health")
        while health.json()["status"] in ("loading", "warming up"):
            health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "kernel exploded" in health.json()["error"]
        assert failures and "warming up failed" in failures[0]


@pytest.mark.parametrize("warmup", [False])
def test_without_warm_up_the_engine_serves_at_once(serve, make_engine, monkeypatch, warmup):
    monkeypatch.setattr(specdec.warmup, "warm_up", lambda engine: pytest.fail("warm-up ran"))
    with serve(make_engine, warmup=warmup) as srv:
        assert chat(srv).status_code == 200
