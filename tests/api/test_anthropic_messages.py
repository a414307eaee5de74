"""POST /v1/messages through a real server with the official `anthropic` SDK: text answers whole
and streamed (the SDK's own accumulator) agree, a forced tool choice yields one `tool_use` block
whose input validates and the conversation goes on with its `tool_result`, a thinking model's
reasoning lands in a `thinking` block, stop sequences are named, and errors come in Anthropic's
shape (unknown model, image blocks, missing max_tokens, a bad API key), while an unknown field is
answered with a warning."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest


from .conftest import MODEL
from .test_reasoning import DEEPSEEK_R1, QWEN3, chain_parts, serve_template  # noqa: F401 - fixtures
from .test_tools import WEATHER, parts, tool_engine  # noqa: F401 - fixture

TOOLS = [{"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER}]
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(serve, parts):  # noqa: F811
    with serve(tool_engine(*parts), api_key="sk-test") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0, timeout=120) as c:
        yield c


def _greedy(salt: str, **extra) -> dict:
    return {"extra_body": {"temperature": 0, "cache_salt": salt, **extra}}


def test_a_text_answer_whole_and_streamed_agree(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=HI, **_greedy("a"))
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 5
    (block,) = whole.content
    with client.messages.stream(model=MODEL, max_tokens=12, system="Be brief.", messages=HI, **_greedy("b")) as stream:
        deltas = [event.delta.text for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert block.type == "text" and "".join(deltas) == block.text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_the_stream_is_anthropics_event_sequence(client):
    events = list(client.messages.create(model=MODEL, max_tokens=6, messages=HI, stream=True, **_greedy("c")))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0 and events[-2].usage.output_tokens == 6


def test_a_forced_tool_choice_is_one_validated_tool_use(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, max_tokens=200, messages=HI, tools=TOOLS, tool_choice={"type": "any"},
                      **_greedy(f"tool-{stream}"))
        if stream:
            with client.messages.stream(**kwargs) as s:
                partial = "".join(e.delta.partial_json for e in s if e.type == "content_block_delta")
                message = s.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        (call,) = message.content
        assert message.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
        assert call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER)
        if stream:
            assert json.loads(partial) == call.input
    follow = client.messages.create(
        model=MODEL, max_tokens=5, tools=TOOLS, messages=HI + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                                         {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
        ], **_greedy("follow"))
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use") and follow.content


def test_a_named_tool_and_one_call_only(client):
    message = client.messages.create(model=MODEL, max_tokens=200, messages=HI, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather",
                                                  "disable_parallel_tool_use": True}, **_greedy("named"))
    assert [b.type for b in message.content] == ["tool_use"] and message.stop_reason == "tool_use"


def test_a_stop_sequence_is_named(client):
    free = client.messages.create(model=MODEL, max_tokens=20, messages=HI, **_greedy("stop-a"))
    text = free.content[0].text
    stop = next(ch for ch in text[2:] if ch.isalnum())  # a character the greedy answer writes
    cut = client.messages.create(model=MODEL, max_tokens=20, messages=HI, stop_sequences=[stop], **_greedy("stop-b"))
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[: text.index(stop)]


def test_count_tokens(client):
    assert client.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 5


def test_errors_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-x", max_tokens=5, messages=HI)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert "image" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        client.messages.create(model=MODEL, max_tokens=5, messages=HI,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    missing = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-test"},
                         json={"model": MODEL, "messages": HI})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as err:
            wrong.messages.create(model=MODEL, max_tokens=5, messages=HI)
    assert err.value.body["error"]["type"] == "authentication_error"


def test_an_unknown_field_is_answered_with_a_warning(client):
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=3, messages=HI,
                                                   extra_body={"temperature": 0, "x_tracing": {"id": 1}})
    assert "x_tracing" in raw.headers["warning"] and raw.parse().usage.output_tokens == 3


def test_reasoning_is_a_thinking_block(serve_template):  # noqa: F811
    """The chain model writes `<think>The quick</think> fox` under Qwen3's template."""
    with serve_template(QWEN3) as srv, anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0) as c:
        whole = c.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hello"}],
                                  extra_body={"temperature": 0})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
            ("thinking", "The quick"), ("text", "fox")]
        assert whole.stop_reason == "end_turn"
        with c.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hello"}],
                               extra_body={"temperature": 0}) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "fox"
    # DeepSeek-R1's template closes an empty block in the prompt when not thinking: all text
    with serve_template(DEEPSEEK_R1) as srv, anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0) as c:
        off = c.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hello"}],
                                thinking={"type": "disabled"}, extra_body={"temperature": 0})
        assert [(b.type, b.text) for b in off.content] == [("text", " fox")]
