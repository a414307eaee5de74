"""Bad input gets OpenAI's error body and the right status, and never reaches the engine."""

from __future__ import annotations

import copy
import threading

import httpx
import pytest

from .conftest import MODEL, chat_body, metric

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def completion_body(**extra):
    return {"model": MODEL, "prompt": "hello", **extra}


def assert_error(response: httpx.Response, status: int, param: str | None = "?", code: str | None = "?") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param != "?":
        assert error["param"] == param, error
    if code != "?":
        assert error["code"] == code, error
    return error


CASES = [
    # (id, path, body, status, param, code)
    ("missing model", CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "?"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", "?"),
    ("empty messages", CHAT, chat_body() | {"messages": []}, 400, "messages", "?"),
    ("bad role", CHAT, chat_body() | {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "?"),
    ("image content", CHAT, chat_body() | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "?", "?"),
    ("temperature negative", CHAT, chat_body(temperature=-0.1), 400, "temperature", "?"),
    ("temperature too high", CHAT, chat_body(temperature=2.5), 400, "temperature", "?"),
    ("temperature not a number", CHAT, chat_body(temperature="hot"), 400, "temperature", "?"),
    ("top_p zero", CHAT, chat_body(top_p=0), 400, "top_p", "?"),
    ("top_p above one", COMPLETIONS, completion_body(top_p=1.5), 400, "top_p", "?"),
    ("top_k below -1", CHAT, chat_body(top_k=-2), 400, "top_k", "?"),
    ("top_k past int64 (would crash the engine step)", CHAT, chat_body(top_k=2**64), 400, "top_k", "?"),
    ("max_tokens zero", CHAT, chat_body(max_tokens=0), 400, "max_tokens", "?"),
    ("max_tokens negative", COMPLETIONS, completion_body(max_tokens=-5), 400, "max_tokens", "?"),
    ("max_tokens over context", CHAT, chat_body(max_tokens=10**6), 400, "max_tokens", "context_length_exceeded"),
    ("max_completion_tokens over context", CHAT, chat_body(max_completion_tokens=2000), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt alone over context", COMPLETIONS, completion_body(prompt=[5] * 600), 400, "prompt",
     "context_length_exceeded"),
    ("n over 16", CHAT, chat_body(n=17), 400, "n", "?"),
    ("best_of=3", COMPLETIONS, completion_body(best_of=3), 400, "best_of", "?"),
    ("17 stop strings", CHAT, chat_body(stop=[f"s{i}" for i in range(17)]), 400, "stop", "?"),
    ("empty stop string", COMPLETIONS, completion_body(stop=[""]), 400, "stop", "?"),
    ("negative seed", CHAT, chat_body(seed=-1), 400, "seed", "?"),
    ("seed over 64 bits", CHAT, chat_body(seed=2**64), 400, "seed", "?"),
    ("top_logprobs without logprobs", CHAT, chat_body(top_logprobs=2), 400, "top_logprobs", "?"),
    ("top_logprobs over 20", CHAT, chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", "?"),
    ("completion logprobs over 20", COMPLETIONS, completion_body(logprobs=21), 400, "logprobs", "?"),
    ("penalty out of range", CHAT, chat_body(presence_penalty=2.5), 400, "presence_penalty", "?"),
    ("repetition_penalty zero", CHAT, chat_body(repetition_penalty=0), 400, "repetition_penalty", "?"),
    ("min_p above one", COMPLETIONS, completion_body(min_p=1.5), 400, "min_p", "?"),
    ("min_tokens over max_tokens", CHAT, chat_body(min_tokens=9, max_tokens=4), 400, "min_tokens", "?"),
    ("logit_bias key not a token id", CHAT, chat_body(logit_bias={"hello": 5}), 400, "logit_bias", "?"),
    ("logit_bias over 100", CHAT, chat_body(logit_bias={"5": 101}), 400, "logit_bias", "?"),
    ("logit_bias past the vocabulary", CHAT, chat_body(logit_bias={"100000": 1}), 400, "logit_bias", "?"),
    ("stop_token_ids past the vocabulary", COMPLETIONS, completion_body(stop_token_ids=[100000]), 400,
     "stop_token_ids", "?"),
    ("negative stop_token_id", COMPLETIONS, completion_body(stop_token_ids=[-1]), 400, "stop_token_ids.0", "?"),
    ("unsupported field", CHAT, chat_body(guided_json={"type": "object"}), 400, "guided_json", "unsupported_parameter"),
    ("unknown field in a message", CHAT, chat_body() | {"messages": [{"role": "user", "content": "x", "x": 1}]},
     400, "messages.0.x", "unknown_parameter"),
    ("tools without a function", CHAT, chat_body(tools=[{"type": "function"}]), 400, "tools.0.function", "?"),
    ("stream_options not an object", CHAT, chat_body(stream=True, stream_options=3), 400, "stream_options", "?"),
    ("k too large", CHAT, chat_body(num_speculative_tokens=17), 400, "num_speculative_tokens", "?"),
    ("batched prompts", COMPLETIONS, completion_body(prompt=["a", "b"]), 400, "prompt", "?"),
    ("empty prompt", COMPLETIONS, completion_body(prompt=""), 400, "prompt", "?"),
    ("token id out of vocabulary", COMPLETIONS, completion_body(prompt=[1, 10**9]), 400, "prompt", "invalid_token_id"),
    ("negative token id", COMPLETIONS, completion_body(prompt=[-1]), 400, "prompt", "invalid_token_id"),
    ("echo with logprobs, streamed", COMPLETIONS, completion_body(echo=True, logprobs=1, stream=True), 400, "?", "?"),
    ("max_tokens 0 without echo", COMPLETIONS, completion_body(max_tokens=0), 400, "?", "?"),
    ("prompt_logprobs too many", COMPLETIONS, completion_body(prompt_logprobs=21), 400, "prompt_logprobs", "?"),
    ("unknown model", CHAT, chat_body() | {"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("unknown model, completions", COMPLETIONS, completion_body(model="x"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request(server, path, body, status, param, code):
    assert_error(httpx.post(server.url + path, json=body, timeout=10), status, param, code)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"model": NaN}'])
def test_malformed_body(server, raw):
    response = httpx.post(server.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + CHAT), 405)


def test_rejections_are_counted_and_nothing_reached_the_engine(server):
    before = metric(server, 'specdec_requests_total{outcome="invalid"}')
    httpx.post(server.url + CHAT, json=chat_body(temperature=9))
    httpx.get(server.url + "/favicon.ico")  # not a generation request: not counted
    assert metric(server, 'specdec_requests_total{outcome="invalid"}') == before + 1
    assert server.engine.snapshot.num_running == 0 and server.app.state.specdec.limiter.active == 0


def test_model_without_chat_template(serve, make_engine):
    engine = make_engine()
    engine.tokenizer = copy.deepcopy(engine.tokenizer)
    engine.tokenizer.chat_template = None
    with serve(engine) as srv:
        assert_error(httpx.post(srv.url + CHAT, json=chat_body()), 400, "messages", "no_chat_template")
        ok = httpx.post(srv.url + COMPLETIONS, json=completion_body(max_tokens=3), timeout=30)
        assert ok.status_code == 200


def test_oversized_body_is_413(serve, make_engine):
    with serve(make_engine(), max_body_bytes=2000) as srv:
        big = chat_body("x" * 5000)
        assert_error(httpx.post(srv.url + CHAT, json=big), 413)

        def chunked():  # no Content-Length: the limit is enforced while reading
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        assert_error(httpx.post(srv.url + CHAT, content=chunked(), headers={"content-type": "application/json"}), 413)
        small = httpx.post(srv.url + CHAT, json=chat_body(max_tokens=2), timeout=30)
        assert small.status_code == 200


def test_api_key(serve, make_engine):
    key = "sk-test-0123456789"
    with serve(make_engine(), api_key=key) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Bearer {key}x"}, {"Authorization": f"Basic {key}"}):
            for method, path in (("POST", CHAT), ("POST", COMPLETIONS), ("GET", "/v1/models")):
                response = httpx.request(method, srv.url + path, json=chat_body(max_tokens=2), headers=headers)
                error = assert_error(response, 401, code="invalid_api_key")
                assert error["type"] == "authentication_error"
                assert response.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {key}"}
        assert httpx.post(srv.url + CHAT, json=chat_body(max_tokens=2), headers=good, timeout=30).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers=good).status_code == 200
        for public in ("/health", "/metrics", "/"):
            assert httpx.get(srv.url + public).status_code == 200


def test_health_is_503_while_loading(serve, make_engine):
    release = threading.Event()

    def slow_factory():
        assert release.wait(20)
        return make_engine()

    with serve(slow_factory, wait=False) as srv:
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert_error(httpx.post(srv.url + CHAT, json=chat_body()), 503, code="model_loading")
        release.set()
        srv.wait_healthy()
        assert httpx.post(srv.url + CHAT, json=chat_body(max_tokens=2), timeout=30).status_code == 200


def test_failed_load_reports_503_with_the_reason(serve):
    def broken_factory():
        raise ValueError("Model 'nope' not found")

    with serve(broken_factory, wait=False) as srv:
        srv.engine.ready.wait(10)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "not found" in health.json()["error"]
        assert_error(httpx.post(srv.url + CHAT, json=chat_body()), 503, code="engine_dead")
