"""At temperature 0, speculative output equals target-only output, token for token."""

import pytest
import torch

from specdec.sampling_params import SamplingParams
from specdec.testing import from_hf, tiny_hf_model

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(pair):
    target, _ = pair
    return [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]


def test_target_only_matches_transformers_generate(hf_target):
    """The plain engine reproduces transformers' greedy generate on the same weights."""
    engine = make_engine(from_hf(hf_target))
    for prompt in PROMPTS[:3]:
        out = engine.generate([prompt], GREEDY)[0].token_ids
        ref = hf_target.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert out == ref


@pytest.mark.parametrize("k", range(1, 9))
def test_draft_model_greedy_equality(pair, reference, k):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=k)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0


def test_always_right_draft_accepts_everything(pair, reference):
    target, _ = pair
    engine = make_engine(target, target, num_speculative_tokens=4)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.acceptance_rate == 1.0
    assert engine.stats.mean_accepted_length > 4.0  # k accepted + bonus, except where max_tokens clips k


def test_always_wrong_draft_still_exact(pair, reference):
    """A draft whose argmax never matches: every draft rejected, output still the target's."""
    target, _ = pair
    wrong = from_hf(tiny_hf_model("llama", seed=7))
    with torch.no_grad():  # draft logits peak on a token the target never picks first
        wrong.lm_head.weight.zero_()
        wrong.lm_head.bias = None
        wrong.lm_head.weight[0].fill_(1.0)
        wrong.model.norm.weight.fill_(1.0)
    engine = make_engine(target, wrong, num_speculative_tokens=3)
    outs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert outs == reference
    assert engine.stats.num_accepted_tokens <= sum(o.count(0) for o in reference)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equality(pair, reference, k):
    target, _ = pair
    engine = make_engine(target, proposer="ngram", num_speculative_tokens=k)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_greedy_equality_under_forced_preemption(pair, reference, proposer):
    target, draft = pair
    engine = make_engine(target, draft if proposer == "draft" else None, proposer=proposer,
                         num_blocks=14, num_speculative_tokens=4)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.scheduler.num_preemptions > 0
    assert all(u["used"] == 0 for u in engine.kv_usage().values())


def test_per_request_k_including_zero(pair, reference):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=4)
    ids = [engine.add_request(p, GREEDY, num_speculative_tokens=k) for p, k in zip(PROMPTS, [0, 2, 4, 7])]
    outs = {}
    while engine.has_unfinished():
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    assert [outs[i] for i in ids] == reference


@pytest.mark.parametrize("k", [2, 5])
def test_hybrid_proposer_greedy_equality(pair, reference, k):
    target, draft = pair
    engine = make_engine(target, draft, proposer="hybrid", num_speculative_tokens=k)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0
