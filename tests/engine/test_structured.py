"""Structured output through the engine (llguidance grammars over the tiny tokenizer): answers match
their JSON schema / regex, end where the grammar does, greedy speculative equals target-only, and a
bad schema is refused before anything is queued."""

import json

import jsonschema
import pytest

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams, StructuredSpec
from specdec.testing import tiny_engine_parts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["fox", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "count", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def parts():
    return tiny_engine_parts()


def engine_of(parts, k: int = 4, proposer: str = "draft") -> Engine:
    target, draft, tokenizer = parts
    config = EngineConfig(dtype="float32", num_blocks=512, block_size=4, proposer=proposer if k else "none",
                          adaptive_k=False, num_speculative_tokens=k)
    return Engine.from_models(config, target, draft if k else None, tokenizer)


def prompts(parts, n: int) -> list[list[int]]:
    tokenizer = parts[2]
    return [tokenizer.encode(f"Give me item {i} as JSON:") for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(parts, temperature):
    engine = engine_of(parts)
    params = SamplingParams(temperature=temperature, max_tokens=300, seed=5,
                            structured=StructuredSpec.json_schema(SCHEMA))
    outs = engine.generate(prompts(parts, 4), params)
    for o in outs:
        assert o.finish_reason == "stop", o.text  # ended by the grammar, not by max_tokens
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.text.startswith('{"name": ')  # the schema's property order, compact separators
    assert engine.stats.num_accepted_tokens > 0


def test_greedy_speculative_equals_target_only_under_a_grammar(parts):
    params = SamplingParams(temperature=0, max_tokens=300, structured=StructuredSpec.json_schema(SCHEMA))
    ps = prompts(parts, 3)
    reference = [o.token_ids for o in engine_of(parts, k=0).generate(ps, params)]
    for k, proposer in ((1, "draft"), (4, "draft"), (6, "draft"), (4, "hybrid")):
        assert [o.token_ids for o in engine_of(parts, k, proposer).generate(ps, params)] == reference, (k, proposer)


def test_json_object_and_regex(parts):
    engine = engine_of(parts)
    out = engine.generate(prompts(parts, 1), SamplingParams(temperature=1.0, seed=2, max_tokens=200,
                                                            structured=StructuredSpec.json_object()))[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may ramble inside a string until max_tokens; the prefix is still JSON-shaped
        assert out.text.startswith("{")
    out = engine.generate(prompts(parts, 1), SamplingParams(temperature=1.0, seed=2, max_tokens=50,
                                                            structured=StructuredSpec.regex(r"(fox|dog)-[0-9]{3}")))[0]
    assert out.finish_reason == "stop"
    assert out.text[:3] in ("fox", "dog") and out.text[3] == "-" and out.text[4:].isdigit() and len(out.text) == 7


def test_an_invalid_schema_is_refused_at_add_request(parts):
    engine = engine_of(parts)
    with pytest.raises(ValueError, match="schema"):
        engine.add_request([1, 2, 3], SamplingParams(structured=StructuredSpec.json_schema({"type": "no-such-type"})))
    with pytest.raises(ValueError, match="regex"):
        engine.add_request([1, 2, 3], SamplingParams(structured=StructuredSpec.regex("(unclosed")))
    with pytest.raises(ValueError):
        StructuredSpec.json_schema("{not json")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredSpec.json_object())
    assert not engine.has_unfinished()


def test_each_grammar_compiles_once_per_engine(parts):
    engine = engine_of(parts)
    spec = StructuredSpec.json_schema(SCHEMA)
    engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    grammars = dict(engine.grammars._grammars)
    engine.add_request([1, 2, 4], SamplingParams(structured=StructuredSpec.json_schema(json.loads(json.dumps(SCHEMA)))))
    assert engine.grammars._grammars == grammars and len(grammars) == 1


def _model_proposer(engine: Engine):
    return getattr(engine.proposer, "model", engine.proposer)


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_forced_drafting_supplies_tokens_and_saves_draft_forwards(parts, proposer, temperature):
    """Where the schema forces tokens (keys, `": "`, `", "`, braces), the grammar proposes them
    without a draft forward: the same answers (greedy: the target-only ones), fewer draft forwards,
    and no fewer drafts accepted."""
    params = SamplingParams(temperature=temperature, max_tokens=300, seed=11, structured=StructuredSpec.json_schema(SCHEMA))
    ps = prompts(parts, 3)
    runs = {}
    for forced in (False, True):
        engine = engine_of(parts, 4, proposer)
        model = _model_proposer(engine)
        model.grammar_forced = forced
        forwards = []
        forward = model._forward
        model._forward = lambda windows: (forwards.append(len(windows)), forward(windows))[1]
        outs = engine.generate(ps, params)
        runs[forced] = ([o.token_ids for o in outs], len(forwards), model.num_forced, engine.stats)
    (plain, plain_forwards, none, _), (tokens, forwards, supplied, stats) = runs[False], runs[True]
    assert none == 0 and supplied > 0
    if temperature == 0:
        assert tokens == plain == [o.token_ids for o in engine_of(parts, 0).generate(ps, params)]
    assert forwards < plain_forwards, (forwards, plain_forwards)
    assert stats.acceptance_rate >= runs[False][3].acceptance_rate - 0.05
