"""Logprobs through the server in OpenAI's formats (chat and the legacy completions one, streamed
and not, read by the official client), and the same numbers with speculation on as off."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from specdec.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from specdec.sequence import TokenLogprobs
from specdec.testing import tiny_tokenizer

from .conftest import MODEL, chat_body
from .test_sse import sse_events

GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "user", "content": "write quicksort"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _check_entry(entry, num_top: int) -> None:
    assert entry.logprob <= 0
    assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token  # part of a character
    assert len(entry.top_logprobs) == num_top
    tops = [t.logprob for t in entry.top_logprobs]
    assert tops == sorted(tops, reverse=True)
    # greedy: the chosen token is the most likely one, with the same logprob
    assert entry.top_logprobs[0].token == entry.token and math.isclose(tops[0], entry.logprob, abs_tol=1e-6)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 24
    for entry in content:
        _check_entry(entry, 3)
    # the bytes join into the text (a random model emits broken UTF-8: both show U+FFFD there)
    assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == out.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


def test_chat_logprobs_stream(client):
    # Both requests at the same prefix-cache state: a first one prefills the whole prompt, a later one
    # only past its cached blocks, and an fp32 torch matmul of fewer rows may round differently.
    client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                                 stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in full.choices[0].logprobs.content]
    for chunk in chunks:  # each chunk's entries are its own tokens
        if chunk.choices and chunk.choices[0].delta.content and chunk.specdec["pieces"]:
            assert len(chunk.choices[0].logprobs.content) == len(chunk.specdec["pieces"])


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="def quicksort(xs):", logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 24
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(24)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == logprob and 1 <= len(top) <= 3  # 2 alternatives + the token
        assert max(top.values()) == logprob  # greedy


def test_completion_logprobs_stream(server):
    body = {"model": MODEL, "prompt": "def quicksort(xs):", "logprobs": 1, "temperature": 0, "max_tokens": 24,
            "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    _, events = sse_events(server, "/v1/completions", {**body, "stream": True})
    parts = [json.loads(d)["choices"][0]["logprobs"] for _, d in events[:-1]]
    parts = [p for p in parts if p]
    joined = {key: [v for p in parts for v in p[key]] for key in full}
    assert joined == full  # text_offset carries on across chunks


def test_logprobs_equal_with_and_without_speculation(server):
    """Accepted, recovered and bonus tokens report the target's logprobs: those of a request that
    drafts nothing, within 1e-4 (fp32)."""
    body = chat_body("write quicksort", temperature=0, max_tokens=48, ignore_eos=True, logprobs=True,
                     top_logprobs=5, stream=True)
    spec, plain = ([json.loads(d) for _, d in sse_events(server, "/v1/chat/completions", b)[1][:-1]]
                   for b in (body, {**body, "num_speculative_tokens": 0}))
    origins = {o for c in spec if "specdec" in c for o in c["specdec"]["origins"]}
    assert {"accepted", "recovered", "bonus"} <= origins, "every kind of speculative token is covered"
    assert {o for c in plain if "specdec" in c for o in c["specdec"]["origins"]} == {"target"}
    spec_entries, plain_entries = (
        [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
        for chunks in (spec, plain)
    )
    assert [e["token"] for e in spec_entries] == [e["token"] for e in plain_entries] and len(spec_entries) == 48
    for a, b in zip(spec_entries, plain_entries):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(a["top_logprobs"], b["top_logprobs"]))


def test_sampled_logprobs_are_of_the_tempered_distribution(client):
    """At temperature T the logprobs are of softmax(logits / T): lower T, more peaked."""
    kwargs = dict(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=5, max_tokens=1, seed=1)
    cold, warm = (client.chat.completions.create(temperature=t, **kwargs).choices[0].logprobs.content[0]
                  for t in (0.2, 1.5))
    assert cold.top_logprobs[0].logprob > warm.top_logprobs[0].logprob
    for entry in (cold, warm):
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-5


def test_token_bytes_join_into_the_text_where_tokens_split_characters():
    tokenizer = tiny_tokenizer()
    texts = TokenTexts(tokenizer)
    text = "Ünïcödé — ☃ 日本語 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in texts(i)[0] for i in ids), "some token holds part of a character"
    assert bytes(b for i in ids for b in texts(i)[1]).decode() == text


def test_impossible_tokens_report_minus_9999():
    texts = TokenTexts(None)
    entry = TokenLogprobs(7, -0.5, [(7, -0.5), (3, float("-inf"))])
    assert chat_logprobs([entry], texts)["content"][0]["top_logprobs"][1] == {
        "token": "token_id:3", "logprob": -9999.0, "bytes": list(b"token_id:3")}
    legacy = completion_logprobs([entry, entry], texts, 5)
    assert legacy["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:3": -9999.0}
    assert legacy["text_offset"] == [5, 5 + len("token_id:7")]
