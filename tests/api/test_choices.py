"""`n` choices of one prompt (streamed and not, sharing the prompt's KV blocks, each with its own
seed, all aborted when the client leaves) and `echo` for completions."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from specdec.testing import pace_steps

from .conftest import MODEL, chat_body, kv_used, metric, wait_until
from .test_sse import sse_events
from .test_validation import assert_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SAMPLED = dict(temperature=0.9, max_tokens=12, seed=7, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_n_choices_with_the_openai_client(client):
    messages = [{"role": "user", "content": "tell me a story"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, n=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1, "differently seeded choices differ"
    for i, text in enumerate(texts):  # choice i samples as an n=1 request with seed + i
        single = client.chat.completions.create(model=MODEL, messages=messages, **(SAMPLED | {"seed": 7 + i}))
        assert single.choices[0].message.content == text
        assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 3 * 12


def test_n_choices_stream_interleaved(server):
    body = chat_body("tell me a story", n=2, temperature=0.9, seed=11, max_tokens=10, ignore_eos=True,
                     stream=True, stream_options={"include_usage": True})
    _, events = sse_events(server, CHAT, body)
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert events[-1][1] == "[DONE]"
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            assert choice["index"] not in finishes, "one finish chunk per choice"
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    full = httpx.post(server.url + CHAT, json={**body, "stream": False}, timeout=30).json()
    assert [c["message"]["content"] for c in full["choices"]] == [texts[0], texts[1]]


def test_completion_choices_and_greedy_equality(client):
    out = client.completions.create(model=MODEL, prompt="def f(x):", n=2, best_of=2, temperature=0, max_tokens=8)
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text


def test_siblings_start_on_the_cached_prompt(server):
    """The siblings wait for the first choice's prompt and reuse its blocks: the target's prefix
    cache is hit for (n - 1) times the prompt's full blocks."""
    salt = uuid.uuid4().hex  # nothing cached yet for this salt
    hits = 'specdec_prefix_cache_hit_tokens_total{pool="target"}'
    before = metric(server, hits)
    body = {"model": MODEL, "prompt": list(range(10, 50)), "n": 3, "max_tokens": 2, "cache_salt": salt}
    out = httpx.post(server.url + COMPLETIONS, json=body, timeout=30).json()
    assert len(out["choices"]) == 3
    assert metric(server, hits) - before >= 2 * 32  # 40 prompt tokens: 4 full 8-token blocks


def test_disconnect_aborts_every_choice(serve, make_engine):
    # Each step paced (20 ms: 8 s for 400 tokens): the tiny engine could otherwise finish all 3 x 400
    # tokens before a client starved of CPU reads its first line, and the slots would be free
    # already (5 ms was not enough while a compiler ran beside the tests).
    engine = make_engine()
    pace_steps(engine, 0.02)
    body = chat_body("a long story", n=3, max_tokens=400, ignore_eos=True, stream=True)
    with serve(engine) as server:
        with httpx.stream("POST", server.url + CHAT, json=body, timeout=30) as response:
            # A name for the iterator: a `for` over a temporary one finalizes it at `break`, which
            # closes the connection, and the server may abort before the assertion reads the slots.
            lines = response.iter_lines()
            for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    break
            assert server.app.state.specdec.limiter.active == 3, "each choice holds a slot"
        state = server.app.state.specdec
        assert wait_until(lambda: state.limiter.active == 0 and kv_used(server) == {"target": 0, "draft": 0})


def test_n_over_max_concurrent_is_a_400(serve, make_engine):
    with serve(make_engine(), max_concurrent=2) as srv:
        assert_error(httpx.post(srv.url + CHAT, json=chat_body(n=3), timeout=30), 400, "n")
        assert httpx.post(srv.url + CHAT, json=chat_body(n=2, max_tokens=2), timeout=30).status_code == 200


@pytest.mark.parametrize("prompt", ["def quicksort(xs):", [5, 6, 7, 8]], ids=["text", "token ids"])
def test_echo_prepends_the_prompt(server, prompt):
    tokenizer = server.engine.info.api_tokenizer
    prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    plain = httpx.post(server.url + COMPLETIONS, json=body, timeout=30).json()["choices"][0]["text"]
    echoed = httpx.post(server.url + COMPLETIONS, json={**body, "echo": True, "n": 2}, timeout=30).json()
    assert [c["text"] for c in echoed["choices"]] == [prompt_text + plain] * 2
    _, events = sse_events(server, COMPLETIONS, {**body, "echo": True, "stream": True})
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == prompt_text
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt_text + plain
