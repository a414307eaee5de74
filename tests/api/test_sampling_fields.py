"""The sampling controls of a request reach the engine: through the server, a request with a
control answers exactly what the Python API answers with the same SamplingParams, and differently
from the same request without it (so the control did something)."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.sampling_params import SamplingParams

from .conftest import MODEL, chat_body

PROMPT = [5, 6, 7, 8, 9, 10]  # token ids: the server and the engine see the same prompt
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)
SAMPLED = dict(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
CASES = [  # (field, value, base request)
    ("max_tokens", 5, GREEDY),
    ("temperature", 0.4, SAMPLED),
    ("top_p", 0.3, SAMPLED),
    ("top_k", 2, SAMPLED),
    ("min_p", 0.3, SAMPLED),
    ("seed", 4, SAMPLED),
    ("presence_penalty", 2.0, GREEDY),
    ("frequency_penalty", 2.0, GREEDY),
    ("repetition_penalty", 3.0, GREEDY),
    ("stop", "@", GREEDY),  # replaced by a piece of the greedy answer
]


@pytest.fixture(scope="module")
def reference(make_engine):
    """The Python API over the same models and configuration as the server's engine."""
    return make_engine()


@pytest.fixture(scope="module")
def eos(reference) -> int:
    return reference.tokenizer.eos_token_id


def _complete(server, **fields) -> dict:
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **fields},
                          timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _expected(reference, **params):
    return reference.generate([PROMPT], SamplingParams(**params))[0]


@pytest.mark.parametrize("field,value,base", CASES, ids=[c[0] for c in CASES])
def test_control_reaches_the_engine(server, reference, field, value, base):
    plain = _complete(server, **base)["choices"][0]["text"]
    if field == "stop":
        value = plain[4:6]
    fields = {**base, field: value}
    text = _complete(server, **fields)["choices"][0]["text"]
    assert text == _expected(reference, **fields).text
    assert text != plain, f"{field}={value!r} changed nothing"


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_penalties_make_the_greedy_answer_repeat_less(reference, field):
    def most_repeats(**params) -> int:
        ids = _expected(reference, **{**GREEDY, "max_tokens": 32}, **params).token_ids
        return max(ids.count(t) for t in ids)

    assert most_repeats(**{field: 2.0}) < most_repeats()


def test_logit_bias_makes_a_token_the_first_greedy_token(server, reference):
    first = _expected(reference, **GREEDY).token_ids[0]
    token = next(t for t in range(50, 300) if t != first and reference.tokenizer.decode([t]).isalpha())
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=0,
                                        logit_bias={str(token): 100})
    assert out.choices[0].logprobs.tokens[0] == reference.tokenizer.decode([token])
    assert out.choices[0].text.startswith(reference.tokenizer.decode([token]))
    assert _expected(reference, temperature=0, max_tokens=4, logit_bias={token: 100}).text == out.choices[0].text


def test_min_tokens_holds_eos_back(server, eos):
    eager = dict(temperature=0, max_tokens=16, logit_bias={str(eos): 100})  # EOS first, unless held back
    assert _complete(server, **eager)["usage"]["completion_tokens"] == 0
    held = _complete(server, **eager, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_the_answer(server, reference):
    ids = _expected(reference, **GREEDY).token_ids
    stop_id = ids[4]
    out = _complete(server, **GREEDY, stop_token_ids=[stop_id])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == ids.index(stop_id) + 1  # the stop token is emitted


def test_ignore_eos_generates_past_eos(server, eos):
    eager = dict(temperature=0, max_tokens=5, logit_bias={str(eos): 100})
    assert _complete(server, **eager)["usage"]["completion_tokens"] == 0
    out = _complete(server, **eager, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens(server):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json=chat_body(max_tokens=10, max_completion_tokens=3, ignore_eos=True))
    assert response.json()["usage"]["completion_tokens"] == 3
