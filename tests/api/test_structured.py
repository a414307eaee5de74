"""`response_format` through a real server with the official openai client: json_schema answers
validate against their schema (chat and completions, streamed and not, several schemas and
prompts), json_object answers are objects, and a bad schema is a 400 naming `response_format`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .conftest import MODEL, chat_body
from .test_validation import assert_error

# Bounded strings and numbers: a random tiny model must still reach the end of the grammar.
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "maximum": 99,
                                                                                       "minimum": -9}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
]
PROMPTS = ["Describe a fox.", "List three colors.", "def quicksort(xs):"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_response_validates(client, stream):
    for i, schema in enumerate(SCHEMAS):
        for temperature in (0.0, 1.0):
            prompt = PROMPTS[i % len(PROMPTS)]
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=200,
                          temperature=temperature, seed=i, response_format=_format(schema))
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kwargs))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                out = client.chat.completions.create(**kwargs)
                text, finish = out.choices[0].message.content, [out.choices[0].finish_reason]
            assert finish == ["stop"], (schema, text)
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_take_response_format(client, stream):
    schema = SCHEMAS[1]
    kwargs = dict(model=MODEL, prompt="for i in range(10):", max_tokens=200, temperature=0,
                  extra_body={"response_format": _format(schema)})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_answers_open_an_object(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                         temperature=0, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_text_format_changes_nothing(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(response_format={"type": "text"}, **kwargs).choices[0].message.content == plain


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    {"type": "json_schema"},
    {"type": "json_object", "json_schema": {"name": "x", "schema": {}}},
    {"type": "yaml"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "unknown": 1}},
], ids=["bad-schema", "no-schema", "schema-without-its-type", "unknown-type", "unknown-field"])
def test_bad_response_formats_get_a_400_naming_the_field(server, response_format):
    for stream in (False, True):
        body = chat_body(response_format=response_format, stream=stream)
        error = assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30), 400)
        assert error["param"].startswith("response_format"), error  # or the nested field, e.g. .type


def test_response_format_with_ignore_eos_is_refused(server):
    body = chat_body(response_format={"type": "json_object"}, ignore_eos=True)
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30), 400, "response_format")
