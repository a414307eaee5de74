"""Tool calling through a real server with the official openai client, on a tiny random model
whose vocabulary has `<tool_call>` / `</tool_call>` as tokens (as Qwen2.5's does): required and
named calls parse and their arguments validate against the function's schema (a random model
only gets there because the arguments are constrained), streamed deltas reassemble to the
non-streamed call, earlier calls and `tool` messages go back through the template, and bad tools
get a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.testing import noisy_twin, tiny_engine_parts

from .conftest import MODEL, chat_body
from .test_validation import assert_error

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
          "required": ["query"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search_code": SEARCH}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
NAMED = {"type": "function", "function": {"name": "search_code"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def parts():
    target, _, tokenizer = tiny_engine_parts(tool_tokens=True, max_len=2048)
    return target, noisy_twin(target), tokenizer


def tool_engine(target, draft, tokenizer) -> Engine:
    """The engine the tool-calling servers run (here, and for /v1/responses, /v1/messages and the
    other call formats)."""
    # Seeded answers reproduce only at a fixed k and fixed prefill chunks: chunks sized from
    # measured step times (the default) split an n > 1 sibling's prompt tail by the machine's
    # load, which rounds differently on the fp32 torch path (seen in CI at temperature 1).
    config = EngineConfig(dtype="float32", num_blocks=512, block_size=8, num_speculative_tokens=4, max_num_seqs=8,
                          adaptive_k=False, max_num_batched_tokens=256)
    return Engine.from_models(config, target, draft, tokenizer)


@pytest.fixture(scope="module")
def tool_server(serve, parts):
    with serve(tool_engine(*parts)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(tool_server):
    with openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _ask(client, stream: bool, **kwargs):
    """(content, [(id, name, arguments)], finish_reason); streamed: reassembled from the deltas."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200) | kwargs
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):  # the first delta of a call: id, type, name, empty arguments
                assert call.id and call.type == "function" and call.function.name, call
                assert call.function.arguments == ""
                calls.append([call.id, call.function.name, ""])
            else:
                assert call.id is None and call.function.name is None, call
                calls[call.index][2] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(c) for c in calls], finish


def _assert_valid(calls, names=tuple(SCHEMAS)):
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_required_and_named_calls_validate(client, stream, tool_choice):
    names = ("search_code",) if tool_choice == NAMED else tuple(SCHEMAS)
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        content, calls, finish = _ask(client, stream, tool_choice=tool_choice, parallel_tool_calls=False,
                                      temperature=temperature, seed=seed)
        assert (content, finish, len(calls)) == (None, "tool_calls", 1), (content, calls)
        _assert_valid(calls, names)


def test_streamed_calls_reassemble_to_the_whole_answer(client):
    for kwargs in (dict(tool_choice="required", temperature=0), dict(tool_choice=NAMED, temperature=1.0, seed=7)):
        whole, streamed = _ask(client, False, **kwargs), _ask(client, True, **kwargs)
        assert _without_ids(streamed) == _without_ids(whole)
        _assert_valid(whole[1])


def _without_ids(answer):
    content, calls, finish = answer
    return content, [call[1:] for call in calls], finish


def test_parallel_calls_each_validate(client, parts):
    # a bias toward "\n" and "<tool_call>" makes the random model open another call whenever it may
    tokenizer = parts[2]
    bias = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 20, str(tokenizer.encode("\n")[0]): 20}
    content, calls, finish = _ask(client, False, tool_choice="required", temperature=0, max_tokens=300,
                                  logit_bias=bias)
    assert len(calls) >= 2, (content, calls)
    assert content is None  # a call cut off by max_tokens is left out, never content
    _assert_valid(calls)


def test_each_of_n_choices_parses_its_own_calls(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=200, temperature=1.0, seed=3, n=2)
    # Each request salted: both prefill the prompt whole. A prefix cached by the first (or by an
    # earlier test) would let the second prefill one row instead, which rounds differently on
    # the fp32 torch path, and at temperature 1 a sample can then differ (seen in CI).
    whole = client.chat.completions.create(**kwargs, extra_body={"cache_salt": "whole"}).choices
    streamed = {0: ["", ""], 1: ["", ""]}
    for chunk in client.chat.completions.create(stream=True, **kwargs, extra_body={"cache_salt": "streamed"}):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                streamed[choice.index][0] += call.function.name or ""
                streamed[choice.index][1] += call.function.arguments or ""
    for choice in whole:
        (call,) = choice.message.tool_calls
        _assert_valid([(call.id, call.function.name, call.function.arguments)])
        assert streamed[choice.index] == [call.function.name, call.function.arguments]


def test_auto_calls_validate_when_the_model_calls(client, parts):
    tool_call = parts[2].convert_tokens_to_ids("<tool_call>")
    for stream in (False, True):
        content, calls, finish = _ask(client, stream, tool_choice="auto", parallel_tool_calls=False, temperature=0,
                                      logit_bias={str(tool_call): 100})
        assert finish == "tool_calls" and len(calls) == 1, (content, calls)
        _assert_valid(calls)


def test_auto_may_answer_in_text(client):
    content, calls, _ = _ask(client, False, tool_choice="auto", temperature=0, max_tokens=30)
    assert calls or content  # a random model: one or the other, never an exception


def test_a_call_cut_by_max_tokens_is_neither_content_nor_a_call(client):
    """OpenAI's answer to a call cut off by max_tokens: finish_reason "length", the complete calls
    only, no half-written tag in `content`."""
    content, calls, finish = _ask(client, False, tool_choice=NAMED, temperature=0, max_tokens=6)
    assert (content, calls, finish) == (None, [], "length")
    content, _, finish = _ask(client, True, tool_choice=NAMED, temperature=0, max_tokens=6)
    assert (content, finish) == (None, "length")


def test_a_named_choice_is_one_call_even_where_the_model_would_go_on(client, parts):
    """With `tool_choice` naming a function, the answer is that one call and then the end, however
    strongly the model leans toward another call (a bias toward "\n" and "<tool_call>" makes the
    random model open one whenever it may); `parallel_tool_calls` does not change that."""
    tokenizer = parts[2]
    bias = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 20, str(tokenizer.encode("\n")[0]): 20}
    for stream in (False, True):
        content, calls, finish = _ask(client, stream, tool_choice=NAMED, temperature=0, max_tokens=300,
                                      logit_bias=bias, parallel_tool_calls=True)
        assert (content, finish, len(calls)) == (None, "tool_calls", 1), (content, calls)
        _assert_valid(calls, ("search_code",))


def test_tool_choice_none_leaves_the_tools_out(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                          tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


def test_the_conversation_continues_after_a_tool_message(client, parts):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    # the template saw the call with its arguments as an object (Qwen2.5's `arguments | tojson`)
    rendered = [dict(m) for m in history]
    rendered[1] = {"role": "assistant", "content": "", "tool_calls": [
        call | {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    text = parts[2].apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert out.usage.prompt_tokens == len(parts[2].encode(text))


def test_tokenize_counts_the_tools_as_chat_does(client, tool_server):
    usage = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=1).usage
    body = {"messages": MESSAGES, "tools": TOOLS}
    assert httpx.post(tool_server.url + "/tokenize", json=body, timeout=30).json()["count"] == usage.prompt_tokens
    assert_error(httpx.post(tool_server.url + "/tokenize", json={"prompt": "x", "tools": TOOLS}, timeout=30), 400)


def test_text_tags_work_where_the_vocabulary_has_no_tag_tokens(server):
    """The default tiny tokenizer has no `<tool_call>` token: the grammar writes the tags as text."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as plain_client:
        tools = [{"type": "function", "function": {"name": "ping", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "maximum": 9, "minimum": 0}},
            "required": ["n"], "additionalProperties": False}}}]
        for stream in (False, True):
            content, calls, finish = _ask(plain_client, stream, messages=[{"role": "user", "content": "hi"}],
                                          tools=tools, tool_choice="required", parallel_tool_calls=False,
                                          temperature=0)
            assert (content, finish) == (None, "tool_calls") and calls[0][1] == "ping", calls
            assert 0 <= json.loads(calls[0][2])["n"] <= 9


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "not json"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
], ids=["duplicate", "bad-name", "bad-schema", "not-a-function", "unknown-named", "choice-without-tools",
        "unknown-choice", "with-response-format", "with-ignore-eos", "legacy-functions", "arguments-not-json",
        "user-tool-calls"])
def test_bad_tool_requests_get_a_400_naming_the_field(tool_server, extra, param):
    for stream in (False, True):
        body = chat_body(stream=stream) | extra
        error = assert_error(httpx.post(tool_server.url + "/v1/chat/completions", json=body, timeout=30), 400)
        assert error["param"] is not None and error["param"].startswith(param), error
