"""No field a client sends is silently ignored. This walks the request schemas: every field must be
classified here as honoured (naming the test that shows its effect), accepted without effect on
the answer (and the answer is then unchanged), or refused (and a non-default value gets a 400
naming it), and must be in docs/serving.md's field table. A new field fails until it is all three."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import httpx
import openai
import pytest

from specdec.api.anthropic import MessagesRequest
from specdec.api.middleware import warning_value
from specdec.api.responses import ResponsesRequest
from specdec.api.schemas import UNSUPPORTED_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

from .conftest import MODEL, chat_body
from .test_validation import assert_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DOCS = Path(__file__).parents[2] / "docs" / "serving.md"
OPENAI = "test_openai_client::"
FIELDS = "test_sampling_fields::"
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)

# field -> ("honoured", "module::test that shows its effect") | ("no effect", a value) | ("refused", a value)
SHARED = {
    "model": ("honoured", OPENAI + "test_errors_surface_as_openai_exceptions"),
    "max_tokens": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "temperature": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "top_p": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "top_k": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "min_p": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "presence_penalty": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "frequency_penalty": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "repetition_penalty": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "logit_bias": ("honoured", FIELDS + "test_logit_bias_makes_a_token_the_first_greedy_token"),
    "min_tokens": ("honoured", FIELDS + "test_min_tokens_holds_eos_back"),
    "stop": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "stop_token_ids": ("honoured", FIELDS + "test_stop_token_ids_end_the_answer"),
    "ignore_eos": ("honoured", FIELDS + "test_ignore_eos_generates_past_eos"),
    "seed": ("honoured", FIELDS + "test_control_reaches_the_engine"),
    "n": ("honoured", "test_choices::test_n_choices_with_the_openai_client"),
    "stream": ("honoured", OPENAI + "test_chat_stream_equals_non_stream"),
    "stream_options": ("honoured", OPENAI + "test_chat_stream_equals_non_stream"),
    "num_speculative_tokens": ("honoured", "test_logprobs::test_logprobs_equal_with_and_without_speculation"),
    "cache_salt": ("honoured", "test_prefix_cache::test_cache_salt_separates_requests"),
    "user": ("no effect", "user-42"),
    "response_format": ("honoured", "test_structured::test_json_schema_response_validates"),
}
CHAT_FIELDS = SHARED | {
    "messages": ("honoured", OPENAI + "test_chat_completion"),
    "max_completion_tokens": ("honoured", FIELDS + "test_max_completion_tokens"),
    "logprobs": ("honoured", "test_logprobs::test_chat_logprobs"),
    "top_logprobs": ("honoured", "test_logprobs::test_chat_logprobs"),
    "metadata": ("no effect", {"tenant": "a"}),
    "store": ("no effect", False),
    "service_tier": ("no effect", "auto"),
    "prompt_cache_key": ("no effect", "key-1"),
    "safety_identifier": ("no effect", "hashed-user"),
    "tools": ("honoured", "test_tools::test_required_and_named_calls_validate"),
    "tool_choice": ("honoured", "test_tools::test_tool_choice_none_leaves_the_tools_out"),
    "parallel_tool_calls": ("honoured", "test_tools::test_parallel_calls_each_validate"),
    "functions": ("refused", [{"name": "f", "parameters": {}}]),
    "function_call": ("refused", "auto"),
    "chat_template_kwargs": ("honoured", "test_reasoning::test_enable_thinking_false_leaves_the_answer_unsplit"),
    "reasoning_effort": ("honoured", "test_reasoning::test_reasoning_effort_reaches_a_template_that_uses_it"),
}
COMPLETION_FIELDS = SHARED | {
    "prompt": ("honoured", OPENAI + "test_completion"),
    "logprobs": ("honoured", "test_logprobs::test_completion_logprobs"),
    "echo": ("honoured", "test_choices::test_echo_prepends_the_prompt"),
    "prompt_logprobs": ("honoured", "test_prompt_logprobs::test_echo_with_logprobs_scores_the_prompt"),
    "best_of": ("refused", 3),
    "suffix": ("refused", "end"),
}
MESSAGE_FIELDS = {
    "role": ("honoured", OPENAI + "test_chat_stream_equals_non_stream"),
    "content": ("honoured", OPENAI + "test_chat_completion"),
    "name": ("honoured", "test_request_fields::test_message_name_and_tool_call_id_reach_the_template"),
    "tool_call_id": ("honoured", "test_request_fields::test_message_name_and_tool_call_id_reach_the_template"),
    "refusal": ("no effect", "I can't help with that."),
    "tool_calls": ("honoured", "test_tools::test_the_conversation_continues_after_a_tool_message"),
    "reasoning_content": ("honoured", "test_reasoning::test_an_earlier_answers_reasoning_reaches_the_template"),
    "function_call": ("refused", {"name": "f", "arguments": "{}"}),
}
STREAM_OPTION_FIELDS = {"include_usage": ("honoured", OPENAI + "test_chat_stream_equals_non_stream")}
SCHEMAS = [(ChatCompletionRequest, CHAT_FIELDS), (CompletionRequest, COMPLETION_FIELDS),
           (ChatMessage, MESSAGE_FIELDS), (StreamOptions, STREAM_OPTION_FIELDS)]


def completion_body(**extra):
    return {"model": MODEL, "prompt": "hello", **extra}


def _cases(kind: str) -> list[tuple[str, str, object]]:
    """(path, field, value) of every top-level field of this kind."""
    return [(path, name, entry[1]) for path, table in ((CHAT, CHAT_FIELDS), (COMPLETIONS, COMPLETION_FIELDS))
            for name, entry in table.items() if entry[0] == kind]


@pytest.mark.parametrize("schema,table", SCHEMAS, ids=[s.__name__ for s, _ in SCHEMAS])
def test_every_field_is_classified(schema, table):
    assert set(schema.model_fields) == set(table), (
        "classify every request field as honoured (with its test), no effect or refused")
    top_level = schema in (ChatCompletionRequest, CompletionRequest)
    assert schema.model_config.get("extra") == ("allow" if top_level else "forbid"), (
        "undeclared top-level fields go through RequestBody.extra_fields; nested ones are refused")


@pytest.mark.parametrize("schema,table", SCHEMAS, ids=[s.__name__ for s, _ in SCHEMAS])
def test_every_honoured_field_names_a_test_that_exists(schema, table):
    for name, (kind, where) in table.items():
        if kind == "honoured":
            module, test = where.split("::")
            assert hasattr(importlib.import_module(f"tests.api.{module}"), test), f"{name}: {where} is missing"


def test_every_field_is_in_the_docs_table():
    docs = DOCS.read_text(encoding="utf-8")
    section = docs[docs.index("### Request fields"):]
    table = "\n".join(line for line in section[: section.index("\n### ", 5)].splitlines() if line.startswith("|"))
    documented = set(re.findall(r"`([a-z_]+)`", table))
    for schema, fields in SCHEMAS:
        missing = set(fields) - documented
        assert not missing, f"{schema.__name__} fields missing from docs/serving.md's table: {sorted(missing)}"


@pytest.mark.parametrize("path,field,value", _cases("refused"), ids=lambda v: str(v)[:20])
def test_refused_fields_get_a_400_naming_them(server, path, field, value):
    body = chat_body(**{field: value}) if path == CHAT else completion_body(**{field: value})
    assert_error(httpx.post(server.url + path, json=body, timeout=30), 400, field)


@pytest.mark.parametrize("field", ["function_call"])
def test_refused_message_fields_get_a_400_naming_them(server, field):
    message = {"role": "assistant", "content": "", field: MESSAGE_FIELDS[field][1]}
    body = chat_body() | {"messages": [{"role": "user", "content": "hi"}, message]}
    assert_error(httpx.post(server.url + CHAT, json=body, timeout=30), 400, f"messages.1.{field}")


@pytest.mark.parametrize("path,field,value", _cases("no effect"), ids=lambda v: str(v)[:20])
def test_fields_without_effect_leave_the_answer_unchanged(server, path, field, value):
    make = chat_body if path == CHAT else completion_body
    plain = httpx.post(server.url + path, json=make(**GREEDY), timeout=30).json()
    sent = httpx.post(server.url + path, json=make(**GREEDY, **{field: value}), timeout=30)
    assert sent.status_code == 200, sent.text
    assert _text(sent.json()) == _text(plain)


def test_a_refusal_message_in_the_history_is_accepted(server):
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "no", "refusal": MESSAGE_FIELDS["refusal"][1]},
               {"role": "user", "content": "why"}]
    assert httpx.post(server.url + CHAT, json=chat_body(**GREEDY) | {"messages": history}, timeout=30).status_code == 200


def test_fields_that_would_change_the_answer_are_refused_by_name(server):
    for path, make in ((CHAT, chat_body), (COMPLETIONS, completion_body)):
        for field in ("use_beam_search", "guided_json", "typical_p", "skip_special_tokens"):
            error = assert_error(httpx.post(server.url + path, json=make(**{field: 1}), timeout=30), 400, field,
                                 "unsupported_parameter")
            assert field in error["message"] and UNSUPPORTED_FIELDS[field] in error["message"]


def test_unknown_fields_are_answered_with_a_warning_naming_them(server):
    for path, make in ((CHAT, chat_body), (COMPLETIONS, completion_body)):
        plain = httpx.post(server.url + path, json=make(**GREEDY), timeout=30)
        assert "warning" not in plain.headers
        sent = httpx.post(server.url + path, json=make(**GREEDY, frequency_penality=1, cache_prompt=True), timeout=30)
        assert sent.status_code == 200, sent.text
        assert sent.headers["warning"] == '299 specdec "ignored unknown fields: cache_prompt, frequency_penality"'
        assert _text(sent.json()) == _text(plain.json())
    with httpx.stream("POST", server.url + CHAT, json=chat_body(stream=True, **GREEDY, x_client="ide"),
                      timeout=30) as streamed:
        assert streamed.status_code == 200 and "x_client" in streamed.headers["warning"]
        assert "[DONE]" in streamed.read().decode()


def test_the_warning_header_escapes_what_a_client_sends():
    value = warning_value(['a"b', "line\nbreak", "é"] + [f"f{i}" for i in range(20)])
    assert value.isascii() and b"\n" not in value and b'a\\"b' in value and value.endswith(b' and 7 more"')
    value.decode("ascii")  # a header h11 sends


@pytest.fixture(scope="module")
def strict_server(serve, make_engine):
    with serve(make_engine(), strict_fields=True) as srv:
        yield srv


def test_strict_fields_refuses_unknown_fields_by_name(strict_server):
    error = assert_error(httpx.post(strict_server.url + CHAT, json=chat_body(frequency_penality=1), timeout=30),
                         400, "frequency_penality", "unknown_parameter")
    assert "--strict-fields" in error["message"]
    assert httpx.post(strict_server.url + CHAT, json=chat_body(**GREEDY), timeout=30).status_code == 200


def test_the_openai_client_sees_the_unsupported_field_named(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"guided_json": {"type": "object"}})
        assert err.value.body["param"] == "guided_json" and err.value.body["code"] == "unsupported_parameter"
        answer = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"cache_prompt": True})
        assert "cache_prompt" in answer.headers["warning"] and answer.parse().choices[0].message is not None


def test_message_name_and_tool_call_id_reach_the_template():
    message = ChatMessage(role="tool", content="42", name="calc", tool_call_id="call-1")
    assert message.as_template_dict() == {"role": "tool", "content": "42", "name": "calc", "tool_call_id": "call-1"}
    assert ChatMessage(role="user", content="hi").as_template_dict() == {"role": "user", "content": "hi"}


def _text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("schema,section", [(ResponsesRequest, "### Responses API"),
                                            (MessagesRequest, "### Anthropic Messages API")],
                         ids=["responses", "messages"])
def test_every_responses_and_messages_field_is_in_its_docs_table(schema, section):
    docs = DOCS.read_text(encoding="utf-8")
    body = docs[docs.index(section):]
    table = "\n".join(line for line in body[: body.index("\n### ", 5)].splitlines() if line.startswith("|"))
    missing = set(schema.model_fields) - set(re.findall(r"`([a-z_]+)`", table))
    assert not missing, f"{schema.__name__} fields missing from docs/serving.md's {section!r} table: {sorted(missing)}"
    assert schema.model_config.get("extra") == "allow"  # RequestBody: unknown fields answered as on chat
