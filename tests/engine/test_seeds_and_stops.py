"""Seeded requests are reproducible whatever else is batched; stops end requests where they should."""

import pytest

from specdec.sampling_params import SamplingParams

from .conftest import PROMPTS, make_engine


def _run_alone_and_batched(engine_factory, prompt, params, others):
    alone = engine_factory().generate([prompt], params)[0].token_ids
    engine = engine_factory()
    rid = engine.add_request(prompt, params)
    for i, p in enumerate(others):
        engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=20, seed=None if i % 2 else 100 + i))
    tokens = []
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id == rid:
                tokens.extend(d.token_ids)
    return alone, tokens


CONTROLS = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.2, logit_bias={12: 1.5}, min_p=0.02,
                min_tokens=3)


@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
@pytest.mark.parametrize("proposer", ["draft", "ngram", "none"])
def test_seeded_request_same_alone_and_batched(pair, proposer, controls):
    target, draft = pair
    factory = lambda: make_engine(  # noqa: E731
        target, draft if proposer == "draft" else None, proposer=proposer, num_speculative_tokens=3
    )
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True,
                            **(CONTROLS if controls else {}))
    alone, batched = _run_alone_and_batched(factory, PROMPTS[0], params, PROMPTS[1:])
    assert alone == batched
    again, _ = _run_alone_and_batched(factory, PROMPTS[0], params, PROMPTS[2:])
    assert again == alone


def test_different_seeds_differ(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    outs = [
        engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=20, seed=s))[0].token_ids
        for s in (1, 2)
    ]
    assert outs[0] != outs[1]


def test_max_tokens_is_exact(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=5)
    for n in (1, 2, 7):
        out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in out)


@pytest.mark.parametrize("proposer", ["draft", "none"])
def test_eos_stops_and_is_not_emitted(pair, proposer):
    """Without ignore_eos, the first EOS the target produces (as a draft it accepted or as its own
    token) ends the request: neither the stream nor the output holds it or anything after it."""
    target, draft = pair
    engine = make_engine(target, draft if proposer == "draft" else None, proposer=proposer, num_speculative_tokens=3)
    ref = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    engine.eos_token_ids = {ref[5]}
    first = ref.index(ref[5])
    params = SamplingParams(temperature=0, max_tokens=12)
    out = engine.generate([PROMPTS[0]], params)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:first]
    deltas = list(engine.stream([PROMPTS[0]], params))
    assert [t for d in deltas for t in d.token_ids] == ref[:first]
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert engine.target.pool.num_used == 0


def test_stop_token_ids(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    ref = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        stop_token_ids=[ref[4]]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: ref.index(ref[4]) + 1]


def test_abort_frees_blocks_at_once(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    rid = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.target.pool.num_used > 0 and engine.proposer.pool.num_used > 0
    assert engine.abort(rid)
    assert engine.target.pool.num_used == 0 and engine.proposer.pool.num_used == 0
    assert not engine.abort(rid)


def test_bad_requests_are_value_errors(pair):
    target, draft = pair
    engine = make_engine(target, draft, max_model_len=16)
    with pytest.raises(ValueError, match="prompt has"):
        engine.add_request(list(range(3, 30)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([3, 10**6])
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_context_limit_finishes_with_length(pair):
    target, draft = pair
    engine = make_engine(target, draft, max_model_len=16, num_speculative_tokens=4)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 16
