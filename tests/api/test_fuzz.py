"""Schemathesis fuzzes every operation in /openapi.json over loopback: valid and invalid bodies,
most of them aimed at the served model so they reach the engine. No answer may be a 5xx, every
error has OpenAI's body, and afterwards the engine is alive with every block and slot released."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import MODEL, kv_used, wait_until

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz test needs schemathesis (test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

MAX_EXAMPLES = 300
TIME_BUDGET_S = 45.0


@pytest.fixture(scope="module")
def fuzz_server(serve, make_engine):
    # A short context bounds every generated request (max_tokens defaults to the room left).
    with serve(make_engine(max_model_len=64), max_body_bytes=64 * 1024) as srv:
        yield srv


def test_fuzz_openapi_finds_no_server_errors(fuzz_server):
    srv = fuzz_server
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    cases = schema.as_strategy() | schema.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    seen: dict[int, int] = {}
    deadline = time.monotonic() + TIME_BUDGET_S

    @given(case=cases, aim=st.integers(0, 3))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case, aim: int) -> None:
        if time.monotonic() > deadline:
            return
        if aim and isinstance(case.body, dict):  # 3 in 4 bodies name the served model
            case.body["model"] = MODEL
        response = case.call(base_url=srv.url, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r} -> {response.text}"
        if response.status_code >= 400:
            body = response.json()
            if case.formatted_path.startswith("/v1/messages"):  # Anthropic's shape
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}

    check()
    print(f"fuzz: status codes {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 10 and seen.get(400, 0) > 10, "the fuzz reached both the engine and validation"
    assert httpx.get(srv.url + "/health").status_code == 200
    state = srv.app.state.specdec
    assert wait_until(lambda: state.limiter.active == 0 and kv_used(srv) == {"target": 0, "draft": 0})
