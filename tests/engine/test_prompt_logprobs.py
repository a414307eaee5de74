"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's; `/v1/completions` `echo` + `logprobs`):
each prompt token's log-probability and top alternatives from the target's prefill equal a plain
forward's log-softmax, whether the prompt is prefilled whole, in chunks beside a decoding stream,
or arrives a second time (its cached blocks hold no logits: it is recomputed); the answer is the
one it is without them."""

from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.testing import from_hf, tiny_hf_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
OTHER = [20, 21, 22, 23]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama")


def _reference(hf, ids: list[int]) -> torch.Tensor:  # [len - 1, V]: row p scores token p + 1
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def _engine(hf, proposer="none", **overrides) -> Engine:
    model = from_hf(hf)
    config = EngineConfig(dtype="float32", num_blocks=64, block_size=4, proposer=proposer, adaptive_k=False,
                          num_speculative_tokens=3, **overrides)
    return Engine.from_models(config, model, from_hf(hf) if proposer == "draft" else None)


def _run(engine, requests):
    """RequestOutputs of `requests` [(prompt, params)] run together."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output(engine._sequences[i]) for i in ids]
    for i in ids:
        engine.release(i)
    return outs


def _check(entries, hf, ids, top):
    ref = _reference(hf, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for p, e in enumerate(entries[1:]):
        assert e.token_id == ids[p + 1]
        assert e.logprob == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4)
        values, top_ids = ref[p].topk(top)
        assert [t for t, _ in e.top] == top_ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("proposer", ["none", "draft"])
def test_prompt_logprobs_equal_a_forwards_log_softmax_whole_chunked_and_cached(hf, proposer):
    engine = _engine(hf, proposer, max_num_batched_tokens=5)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    plain = engine.generate([PROMPT], greedy)[0]  # its blocks now cached
    # chunks of 5 beside a decoding stream; then the same prompt again (recomputed, not cached)
    outs = _run(engine, [(OTHER, greedy), (PROMPT, asked)]) + _run(engine, [(PROMPT, asked)])
    for out in outs[1:]:
        _check(out.prompt_logprobs, hf, PROMPT, 3)
        assert out.token_ids == plain.token_ids and out.num_cached_tokens == 0
    assert outs[0].prompt_logprobs is None
    assert engine.target.pool.num_free == engine.target.pool.num_blocks


def test_the_first_delta_carries_them_and_a_one_token_prompt_has_none(hf):
    engine = _engine(hf)
    rid = engine.add_request(PROMPT[:6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0))
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == rid]
    _check(deltas[0].prompt_logprobs, hf, PROMPT[:6], 0)
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    one = engine.generate([[7]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert one.prompt_logprobs == [None]


def test_prompt_logprobs_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
