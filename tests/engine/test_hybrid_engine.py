"""Hybrid models through the engine (issue 61): target-only decoding is transformers' greedy
generate; speculative decoding (the model as its own draft, another hybrid as the draft, prompt
lookup) gives the same tokens, its rejected drafts rolled back by restarting from the kept state;
breaking that restart breaks the equality (negative control); the state slots all come back."""

import pytest
import torch

from specdec import Engine, EngineConfig
from specdec.cache import RecurrentStateCache
from specdec.sampling_params import SamplingParams
from specdec.testing import from_hf, noisy_twin
from tests.target.hybrid_models import hybrid_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _engine(target, draft=None, **overrides) -> Engine:
    kwargs = dict(dtype="float32", num_blocks=64, block_size=4, proposer="draft" if draft is not None else "none",
                  adaptive_k=False, num_speculative_tokens=4, max_num_seqs=4)
    kwargs.update(overrides)
    return Engine.from_models(EngineConfig(**kwargs), target, draft)


def _tokens(engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def _assert_all_released(engine):
    for runner in engine.runners:
        assert runner.states.pool.num_free == runner.states.pool.num_slots
        assert runner.pool.num_free == runner.pool.num_blocks


@pytest.fixture(scope="module", params=["dense", "moe", "qwen3.5", "qwen3.5-moe"])
def models(request):
    hf = hybrid_hf_model(request.param)
    target = from_hf(hf)
    return hf, target, noisy_twin(target, sigma=0.05)  # a draft kept part of the time


def test_target_only_is_transformers_greedy_generate(models):
    hf, target, _ = models
    engine = _engine(target)
    assert not engine.target.pool.enable_caching  # no state snapshots at block ends: prefix caching off
    for prompt, out in zip(PROMPTS[:2], _tokens(engine, PROMPTS[:2])):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out == ref
    _assert_all_released(engine)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_greedy_equals_target_only(models, k):
    _, target, draft = models
    reference = _tokens(_engine(target))
    own = _engine(target, target, num_speculative_tokens=k)  # the model as its own draft: all accepted
    assert _tokens(own) == reference and own.stats.acceptance_rate == 1.0
    other = _engine(target, draft, num_speculative_tokens=k)  # a noisy twin: drafts rejected, rolled back
    assert _tokens(other) == reference
    assert 0 < other.stats.num_accepted_tokens < other.stats.num_draft_tokens
    lookup = _engine(target, proposer="ngram", num_speculative_tokens=k)
    assert _tokens(lookup, [p * 3 for p in PROMPTS]) == _tokens(_engine(target), [p * 3 for p in PROMPTS])
    for engine in (own, other, lookup):
        _assert_all_released(engine)


def test_breaking_the_rollback_breaks_the_equality(models, monkeypatch):
    """Negative control: a forward that starts from the latest state instead of the one as of the
    table's length (rejected drafts kept in the state) no longer gives the target's tokens."""
    _, target, draft = models
    reference = _tokens(_engine(target))
    batch = RecurrentStateCache.batch

    def latest(self, slots, starts, ends):
        starts = [max([p for p in self.positions[s] if p >= 0], default=0) for s in slots]
        ends = [max(e, s) for s, e in zip(starts, ends)]
        return batch(self, slots, starts, ends)

    monkeypatch.setattr(RecurrentStateCache, "batch", latest)
    assert _tokens(_engine(target, draft)) != reference


def test_sampling_is_seeded_and_preemption_recomputes_the_state(models):
    _, target, draft = models
    sampled = SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
    a = _tokens(_engine(target, draft), params=sampled)
    assert a == _tokens(_engine(target, draft), params=sampled)
    tight = _engine(target, draft, num_blocks=12)  # too few blocks for all four: preempted and recomputed
    assert _tokens(tight) == _tokens(_engine(target))
    assert tight.scheduler.num_preemptions > 0
    _assert_all_released(tight)


def test_trees_and_handoff_are_refused_clearly(models):
    _, target, draft = models
    with pytest.raises(ValueError, match="hybrid"):
        _engine(target, draft, spec_tree="on")
    with pytest.raises(ValueError, match="hybrid"):
        _engine(target, proposer="recycling")
    engine = _engine(target)
    with pytest.raises(ValueError, match="hybrid"):
        engine._movable_runners()


def test_the_states_come_out_of_the_memory_budget(models):
    _, target, _ = models
    config = dict(dtype="float32", block_size=4, proposer="none", max_num_seqs=4, num_speculative_tokens=4)
    engine = Engine.from_models(EngineConfig(kv_cache_memory_gib=0.01, **config), target)
    states = engine.target.states
    assert states.pool.num_slots == 4 and states.depth == 6
    kv = engine.target.kv_cache.kv
    assert kv.numel() * kv.element_size() + states.memory_bytes <= 0.01 * 2**30
    assert engine.target.kv_cache.spec.num_layers == 1  # the one full-attention layer's KV only
    with pytest.raises(ValueError, match="recurrent states of 4 sequences"):
        Engine.from_models(EngineConfig(kv_cache_memory_gib=1e-6, **config), target)
