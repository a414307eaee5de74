"""The tool-call grammar (specdec.tool_grammar) over the tiny tokenizer, with `<tool_call>` as plain
text and as single tokens (as in Qwen2.5's vocabulary): well-formed calls are accepted, a wrong
name or argument is not, free text is allowed only with `free_text` and never turns into an
unconstrained call; through the engine a random model's call validates and greedy speculative
decoding equals target-only under it."""

import json

import jsonschema
import pytest

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams, StructuredSpec
from specdec.structured import GrammarCompiler
from specdec.testing import tiny_engine_parts, tiny_tokenizer
from specdec.tool_grammar import ToolGrammarSpec, tool_call_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
FUNCTIONS = [("get_weather", WEATHER), ("ping", None)]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def _constraint(tag_tokens: bool, **kwargs):
    tokenizer = tiny_tokenizer(tool_tokens=tag_tokens)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    spec = ToolGrammarSpec.build(FUNCTIONS, tag_tokens=tag_tokens, **kwargs)
    return tokenizer, lambda: compiler.constraint(StructuredSpec.lark(tool_call_grammar(spec)))


def _accepts(tokenizer, make, text: str) -> tuple[bool, bool]:
    """(every token of `text` is allowed, the grammar may end there)"""
    matcher = make()._matcher
    ids = tokenizer.encode(text)
    return matcher.try_consume_tokens(ids) == len(ids), matcher.is_accepting()


@pytest.mark.parametrize("tag_tokens", [False, True], ids=["text-tags", "token-tags"])
def test_calls_only(tag_tokens):
    tokenizer, make = _constraint(tag_tokens, free_text=False, parallel=True)
    assert _accepts(tokenizer, make, CALL) == (True, True)
    assert _accepts(tokenizer, make, CALL + "\n" + PING) == (True, True)
    assert _accepts(tokenizer, make, "Sure. " + CALL)[0] is False  # no text before a call
    assert _accepts(tokenizer, make, CALL.replace("get_weather", "get_weather2"))[0] is False
    assert _accepts(tokenizer, make, CALL.replace('"celsius"', '"kelvin"'))[0] is False
    assert _accepts(tokenizer, make, CALL.replace('"Paris"', '"Paris, France"'))[0] is False  # maxLength 8
    assert _accepts(tokenizer, make, CALL[:CALL.index("}}")]) == (True, False)  # unfinished


@pytest.mark.parametrize("tag_tokens", [False, True], ids=["text-tags", "token-tags"])
def test_one_call_without_parallel(tag_tokens):
    tokenizer, make = _constraint(tag_tokens, free_text=False, parallel=False)
    constraint = make()
    constraint.commit(tokenizer.encode(CALL))
    assert constraint.done  # only EOS may follow
    assert _accepts(tokenizer, make, CALL + "\n" + PING)[0] is False


@pytest.mark.parametrize("tag_tokens", [False, True], ids=["text-tags", "token-tags"])
def test_free_text_or_constrained_calls(tag_tokens):
    tokenizer, make = _constraint(tag_tokens, free_text=True, parallel=True)
    assert _accepts(tokenizer, make, "Just text, <tool and no call.") == (True, True)
    assert _accepts(tokenizer, make, "Let me look.\n" + CALL) == (True, True)
    # once a call opens, its arguments are the schema's, not free text
    assert _accepts(tokenizer, make, "Let me look.\n" + CALL.replace('"celsius"', '"kelvin"'))[0] is False
    assert _accepts(tokenizer, make, '<tool_call>\n{"name": "nope"')[0] is False


FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "celsius"}\n}\n```'


@pytest.mark.parametrize("tag_tokens", [False, True], ids=["text-tags", "token-tags"])
def test_auto_takes_a_fenced_call_constrained_too(tag_tokens):
    """Qwen2.5-Coder writes calls as ```json blocks: at the answer's start such a block is a call,
    held to the schema; other code blocks stay free text."""
    tokenizer, make = _constraint(tag_tokens, free_text=True, parallel=True)
    assert _accepts(tokenizer, make, FENCED) == (True, True)
    assert _accepts(tokenizer, make, FENCED.replace('"celsius"', '"kelvin"'))[0] is False
    assert _accepts(tokenizer, make, FENCED.replace('"get_weather"', '"get_time"'))[0] is False
    assert _accepts(tokenizer, make, '```json\n{"title": "x"}\n```') == (True, True)
    assert _accepts(tokenizer, make, "```python\nprint(1)\n```") == (True, True)
    _, calls_only = _constraint(tag_tokens, free_text=False, parallel=True)
    assert _accepts(tokenizer, calls_only, FENCED)[0] is False


def test_functions_without_parameters_take_an_empty_object():
    tokenizer, make = _constraint(False, free_text=False, parallel=False)
    assert _accepts(tokenizer, make, PING) == (True, True)
    assert _accepts(tokenizer, make, PING.replace("{}", '{"x": 1}'))[0] is False


@pytest.mark.parametrize("tag_tokens", [False, True], ids=["text-tags", "token-tags"])
def test_a_random_model_calls_validly_and_speculation_changes_nothing(tag_tokens):
    target, draft, tokenizer = tiny_engine_parts(tool_tokens=tag_tokens)
    spec = ToolGrammarSpec.build(FUNCTIONS, free_text=False, parallel=False, tag_tokens=tag_tokens)
    structured = StructuredSpec.lark(tool_call_grammar(spec))
    prompts = [tokenizer.encode(f"Call a tool {i}:") for i in range(3)]
    texts = {}
    for k in (0, 4):
        config = EngineConfig(dtype="float32", num_blocks=512, block_size=4, proposer="draft" if k else "none",
                              adaptive_k=False, num_speculative_tokens=k)
        engine = Engine.from_models(config, target, draft if k else None, tokenizer)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=200, structured=structured))
        texts[k] = [o.text for o in outs]
        for o in outs:
            assert o.finish_reason == "stop", o.text
            body = o.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
            call = json.loads(body)
            if call["name"] == "get_weather":
                jsonschema.validate(call["arguments"], WEATHER)
            else:
                assert call == {"name": "ping", "arguments": {}}
    assert texts[0] == texts[4]
