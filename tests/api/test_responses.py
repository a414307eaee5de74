"""POST /v1/responses through a real server with the official `openai` SDK (`client.responses`):
text whole and streamed agree (events in OpenAI's order, numbered), a forced tool choice yields
one validated `function_call`, `previous_response_id` continues the stored conversation from the
prefix cache, a thinking model's reasoning is a `reasoning` item, structured `text.format`
holds, and unsupported inputs are refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest


from .conftest import MODEL
from .test_reasoning import QWEN3, chain_parts, serve_template  # noqa: F401 - fixtures
from .test_tools import WEATHER, parts, tool_engine  # noqa: F401 - fixture

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server(serve, parts):  # noqa: F811
    with serve(tool_engine(*parts)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _salted(salt: str) -> dict:
    return {"extra_body": {"cache_salt": salt}}


def test_text_whole_and_streamed_agree(client):
    kwargs = dict(model=MODEL, input="What is the weather in Paris?", instructions="Be brief.", max_output_tokens=10,
                  temperature=0)
    whole = client.responses.create(**kwargs, **_salted("a"))
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 10
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    events = list(client.responses.create(**kwargs, stream=True, **_salted("b")))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_forced_tool_choice_is_one_validated_function_call(client):
    kwargs = dict(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    whole = client.responses.create(**kwargs, **_salted("tool-a"))
    (call,) = whole.output
    assert whole.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**kwargs, **_salted("tool-b")) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert deltas == final.output[0].arguments == call.arguments


def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                    temperature=0, **_salted("chain"))
    call = first.output[0]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=5, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}], **_salted("chain"))
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 8  # all but a block
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    assert err.value.body["code"] == "previous_response_not_found"


def test_the_same_conversation_as_items(client):
    """Input items with the earlier call and its output render the prompt the chained request did."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    answer = client.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=4, temperature=0)
    assert answer.usage.output_tokens <= 4


def test_json_schema_text_format_holds(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.responses.create(model=MODEL, input="Answer in JSON.", max_output_tokens=60, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(answer.output_text), schema)


def test_unsupported_inputs_are_refused_by_name(client):
    for kwargs, param in ((dict(tools=[{"type": "web_search"}]), "tools.0.type"),
                          (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                           "input.0.content.0"),
                          (dict(background=True), "background"), (dict(text={"format": "json"}), "text.format"),
                          (dict(reasoning={"effort": 3}), "reasoning.effort")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(**({"model": MODEL, "input": "hi"} | kwargs))
        assert err.value.body["param"] == param


def test_reasoning_is_a_reasoning_item(serve_template):  # noqa: F811
    with serve_template(QWEN3) as srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        answer = c.responses.create(model=MODEL, input="hello", max_output_tokens=20, temperature=0)
        assert [item.type for item in answer.output] == ["reasoning", "message"] and answer.status == "completed"
        assert answer.output[0].content[0].text == "The quick" and answer.output_text == "fox"
        with c.responses.stream(model=MODEL, input="hello", max_output_tokens=20, temperature=0) as stream:
            reasoning = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
            final = stream.get_final_response()
        assert reasoning == "The quick" and final.output_text == "fox"


def test_the_store_is_bounded_by_count_and_text(monkeypatch):
    from collections import OrderedDict

    from specdec.api import responses

    monkeypatch.setattr(responses, "STORED", 3)
    monkeypatch.setattr(responses, "STORED_CHARS", 110)  # three of these (34 characters each)
    store: OrderedDict = OrderedDict()
    for i in range(5):
        responses._keep(store, f"r{i}", responses.Stored({}, [{"role": "user", "content": "x"}]))
    assert list(store) == ["r2", "r3", "r4"]
    responses._keep(store, "big", responses.Stored({}, [{"role": "user", "content": "y" * 90}]))
    assert list(store) == ["big"]  # the newest is kept even alone over the budget
