"""The tool-call parser (specdec.api.tool_calls): whole answers split into content and calls, and
the same answer fed in any pieces streams events that reassemble to exactly that; truncated or
malformed calls never raise."""

from __future__ import annotations

import random

import pytest

from specdec.api.tool_calls import ArgumentsDelta, CallStart, ContentDelta, ToolCallParser, split_tool_calls

TWO_CALLS = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": {"y": "}"}}}\n</tool_call>\n'
             '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


FENCED = ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "celsius"\n'
          '  }\n}\n```')


def _calls(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_whole_answer_splits_into_content_and_calls():
    content, calls = split_tool_calls(TWO_CALLS)
    assert content == "Sure."
    assert _calls(calls) == [("f", '{"x": {"y": "}"}}'), ("g", "{}")]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text,content,calls", [
    ("plain text < not a tag <tool  end  ", "plain text < not a tag <tool  end  ", []),
    ("", None, []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", '{"x": 1}')]),
    # another key order or spacing (an unconstrained model): the arguments re-serialized
    ('x <tool_call>\n{ "arguments" : {"a":1}, "name": "h" }\n</tool_call>', "x", [("h", '{"a": 1}')]),
    # cut off by max_tokens: neither content nor a call (OpenAI: the complete calls only)
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1', None, []),
    ('ok <tool_call>\n{"na', "ok", []),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "add', None, [("f", "{}")]),
    ('<tool_call>\nnot json\n</tool_call>', '<tool_call>\nnot json\n</tool_call>', []),
    # Qwen2.5-Coder's ```json block at the start of the answer is a call; elsewhere, or not a call: text
    (FENCED, None, [("get_weather", '{\n    "city": "Paris",\n    "unit": "celsius"\n  }')]),
    ("See:\n" + FENCED, "See:\n" + FENCED, []),
    ('```json\n{"title": "x"}\n```', '```json\n{"title": "x"}\n```', []),
    ("```py", "```py", []),
], ids=["text", "empty", "call", "foreign-order", "cut-in-arguments", "cut-in-name", "cut-second-call", "not-json", "fenced",
        "fenced-after-text", "fenced-not-a-call", "fence-cut"])
def test_split(text, content, calls):
    got_content, got_calls = split_tool_calls(text)
    assert (got_content, _calls(got_calls)) == (content, calls)


@pytest.mark.parametrize("text", [TWO_CALLS, "a b  c\n", 'hi <tool_call>\n{"name": "f", "arguments": {"x": 1',
                                  FENCED, FENCED[:60], "```json\n[1, 2]\n```"])
def test_streamed_pieces_reassemble_to_the_whole_answer(text):
    whole_content, whole_calls = split_tool_calls(text)
    rng = random.Random(0)
    for _ in range(100):
        parser, events, at = ToolCallParser(), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            events += parser.feed(text[at:at + step])
            at += step
        events += parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = []
        for event in events:
            if isinstance(event, CallStart):
                assert event.index == len(calls)
                calls.append([event.name, ""])
            elif isinstance(event, ArgumentsDelta):
                assert event.text
                calls[event.index][1] += event.text
        if parser.truncated_call is not None and len(calls) > parser.num_complete:
            calls.pop()  # streamed as far as it went; whole: left out
        assert (content or None, calls) == (whole_content, [list(c) for c in _calls(whole_calls)])


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser()
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"query": "quick')
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    assert events[1].text == '{"query": "quick'
    assert parser.feed('sort"}') == [ArgumentsDelta(0, 'sort"')]  # the "}" may close the call: held
    assert parser.feed("}\n</tool_c") == [ArgumentsDelta(0, "}")]
    assert parser.feed("all>") == []
    assert parser.num_complete == 1
