"""The official `openai` client talks to `specdec serve` as it would to OpenAI: both endpoints,
streaming and not, and greedy streaming gives exactly the non-streamed text."""

from __future__ import annotations

import openai
import pytest

from .conftest import MODEL

GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], **GREEDY
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="def quicksort(xs):", **GREEDY)
    assert out.object == "text_completion"
    assert out.choices[0].text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 24


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="for i in range(10):", **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="for i in range(10):", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_from_token_ids_and_stop_string(client):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], **GREEDY)
    text = out.choices[0].text
    stop = text[3:5]
    assert stop, "the greedy text is long enough to pick a stop string from it"
    stopped = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], stop=[stop], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.9, top_p=0.9,
                  max_tokens=16, seed=7, extra_body={"top_k": 20, "ignore_eos": True})
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    second = client.chat.completions.create(**kwargs).choices[0].message.content
    assert first == second


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3)
    assert err.value.body["param"] == "temperature"
