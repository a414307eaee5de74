"""Token trees in the engine's step (issue 62), draft-free (`proposer="recycling"`): the greedy
tokens are target-only's, bitwise; pools end at zero; logprobs read each token's own row."""

import pytest

from specdec.sampling_params import SamplingParams

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(pair):
    target, _ = pair
    return [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k,rows", [(1, 1), (3, 6), (5, 12), (8, 30)])
def test_recycling_trees_give_the_target_only_tokens(pair, reference, k, rows):
    target, _ = pair
    engine = make_engine(target, proposer="recycling", num_speculative_tokens=k, tree_rows=rows, num_blocks=128)
    for _ in range(2):  # the second pass runs on a table the first one filled
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0
    assert all(u["used"] == 0 for u in engine.kv_usage().values())


def test_recycling_trees_under_the_adaptive_policy_and_preemption(pair, reference):
    """The default adaptive k with tree rows, and a pool small enough to preempt mid-tree: same
    tokens, nothing left held."""
    target, _ = pair
    engine = make_engine(target, proposer="recycling", num_speculative_tokens=5, tree_rows=12,
                         adaptive_k=True, num_blocks=20)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.scheduler.num_preemptions > 0
    assert all(u["used"] == 0 for u in engine.kv_usage().values())


def test_trees_on_a_parallel_target_are_refused_clearly():
    from specdec.config import EngineConfig

    with pytest.raises(ValueError, match="one-process target"):
        EngineConfig(proposer="recycling", draft=None, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tree_rows"):
        EngineConfig(proposer="recycling", draft=None, tree_rows=64)
