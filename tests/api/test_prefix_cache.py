"""Prefix caching as clients see it: `usage.prompt_tokens_details.cached_tokens`, the `cache_salt`
extension, and the prefix-cache counters and cached KV blocks on /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import MODEL, chat_body, metric
from .test_validation import assert_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LONG = "The quick brown fox jumps over the lazy dog. " * 4  # several 8-token blocks once templated
GREEDY = dict(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture
def srv(serve, make_engine):
    """A fresh server per test: an empty prefix cache and counters at zero."""
    with serve(make_engine(num_blocks=128)) as server:
        yield server


def _body(path: str, prompt: str = LONG, **extra) -> dict:
    if path == CHAT:
        return chat_body(prompt, **GREEDY, **extra)
    return {"model": MODEL, "prompt": prompt, **GREEDY, **extra}


def _usage(srv, path: str, **extra) -> dict:
    response = httpx.post(srv.url + path, json=_body(path, **extra), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def _stream_usage(srv, path: str, **extra) -> dict:
    body = _body(path, stream=True, stream_options={"include_usage": True}, **extra)
    with httpx.stream("POST", srv.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        data = [line[len("data:"):].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["choices"] == []
    return last["usage"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_repeated_prompt_reports_cached_tokens(srv, path):
    first = _usage(srv, path)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _usage(srv, path)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert 0 < cached < second["prompt_tokens"]  # whole blocks only; the last token is always computed
    assert cached % 8 == 0  # block_size=8
    streamed = _stream_usage(srv, path)
    assert streamed["prompt_tokens_details"]["cached_tokens"] == cached
    assert streamed["total_tokens"] == streamed["prompt_tokens"] + streamed["completion_tokens"]


def test_cache_salt_separates_requests(srv):
    assert _usage(srv, CHAT, cache_salt="tenant-a")["prompt_tokens_details"]["cached_tokens"] == 0
    assert _usage(srv, CHAT, cache_salt="tenant-b")["prompt_tokens_details"]["cached_tokens"] == 0
    assert _usage(srv, CHAT)["prompt_tokens_details"]["cached_tokens"] == 0  # no salt: its own namespace
    assert _usage(srv, CHAT, cache_salt="tenant-a")["prompt_tokens_details"]["cached_tokens"] > 0
    assert _stream_usage(srv, COMPLETIONS, cache_salt="x")["prompt_tokens_details"]["cached_tokens"] == 0
    assert _stream_usage(srv, COMPLETIONS, cache_salt="x")["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("salt", ["", 123, ["a"]])
def test_bad_cache_salt_is_a_400_naming_the_field(server, path, salt):
    response = httpx.post(server.url + path, json=_body(path, cache_salt=salt), timeout=10)
    error = assert_error(response, 400, "cache_salt", "invalid_value")
    if salt == "":
        assert "non-empty" in error["message"]


def test_openai_client_reads_cached_tokens(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": LONG}]
    outs = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"cache_salt": "s1"}) for _ in range(2)]
    assert outs[0].usage.prompt_tokens_details.cached_tokens == 0
    assert outs[1].usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_count_prefix_cache_tokens_per_pool(srv):
    def counters() -> dict[str, float]:
        return {f"{kind}/{pool}": metric(srv, f'specdec_prefix_cache_{kind}_tokens_total{{pool="{pool}"}}')
                for kind in ("queried", "hit") for pool in ("target", "draft")}

    assert set(counters().values()) == {0.0}
    first = _usage(srv, CHAT)
    after_one = counters()
    assert after_one["queried/target"] == first["prompt_tokens"] and after_one["hit/target"] == 0
    second = _usage(srv, CHAT)
    after_two = counters()
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert after_two["queried/target"] == 2 * first["prompt_tokens"]
    assert after_two["hit/target"] == cached > 0
    assert after_two["hit/draft"] > 0
    assert all(after_two[k] >= after_one[k] for k in after_two)  # counters only grow
    assert counters() == after_two  # a second scrape counts nothing twice
    text = httpx.get(srv.url + "/metrics").text
    assert "# TYPE specdec_prefix_cache_hit_tokens_total counter" in text
    assert "# TYPE specdec_prefix_cache_queried_tokens_total counter" in text

    for pool in ("target", "draft"):  # finished requests leave their full blocks cached (and free)
        cached_blocks = metric(srv, f'specdec_kv_blocks{{pool="{pool}",state="cached"}}')
        assert 0 < cached_blocks <= metric(srv, f'specdec_kv_blocks{{pool="{pool}",state="free"}}') == 128
        assert metric(srv, f'specdec_kv_blocks{{pool="{pool}",state="used"}}') == 0


def test_prefix_cache_off_reports_no_hits(serve, make_engine):
    with serve(make_engine(enable_prefix_caching=False)) as srv:
        for _ in range(2):
            assert _usage(srv, CHAT)["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(srv, 'specdec_prefix_cache_hit_tokens_total{pool="target"}') == 0
        assert metric(srv, 'specdec_kv_blocks{pool="target",state="cached"}') == 0
