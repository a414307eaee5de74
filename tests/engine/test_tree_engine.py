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


# ---- the draft model's trees (`spec_tree="on"`, `draft.model_tree`) -------------------------------


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
@pytest.mark.parametrize("k,rows", [(1, 1), (3, 6), (5, 12), (8, 30)])
def test_draft_model_trees_give_the_target_only_tokens(pair, reference, proposer, k, rows):
    """Greedy: bitwise target-only's tokens; both pools at zero after."""
    target, draft = pair
    engine = make_engine(target, draft, proposer=proposer, spec_tree="on", num_speculative_tokens=k,
                         tree_rows=rows, num_blocks=128)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0
    assert all(u["used"] == 0 for u in engine.kv_usage().values())


def _draft_kv_is_a_fresh_prefills(engine, seq) -> bool:
    """The draft cache's KV of `seq`'s computed tokens equals a fresh prefill of them."""
    import torch

    from specdec.cache import BlockTable
    from specdec.target.runner import Window

    runner = engine.proposer.runner
    table = seq.draft_table
    n = table.num_computed
    fresh = BlockTable(runner.pool, block_size=table.block_size)
    assert fresh.ensure_slots(n)
    runner.forward([Window(fresh, seq.token_ids[:n], 0)])
    kv = runner.kv_cache.kv.flatten(2, 3)  # [L, 2, N * S, Hkv, D]
    ok = torch.allclose(kv[:, :, table.slot_mapping(0, n)], kv[:, :, fresh.slot_mapping(0, n)], atol=1e-4)
    fresh.free()
    return ok


def test_draft_model_trees_keep_the_accepted_paths_kv_in_the_draft_cache(pair):
    """After every step the draft cache holds, at each position, the KV of the token there (the
    accepted path's fed nodes moved into place, the rest dropped): what a fresh prefill gives.
    The target is its own draft, so paths of fed nodes are accepted."""
    target, _ = pair
    engine = make_engine(target, target, spec_tree="on", num_speculative_tokens=5, tree_rows=10,
                         num_blocks=128, enable_prefix_caching=False)
    engine.add_request(PROMPTS[0], GREEDY)
    moved = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert _draft_kv_is_a_fresh_prefills(engine, seq)
            tree = engine.proposer.trees[0] if engine.proposer.trees else None
            moved += tree is not None and any(f >= 0 for f in tree.fed)
    assert moved > 0 and engine.stats.num_accepted_tokens > 0


def test_priced_draft_trees_give_the_target_only_tokens_and_follow_the_price(pair, reference):
    """`spec_tree="auto"` (adaptive k): the same greedy tokens, pools at zero; a node joins only
    where its measured worth pays the planner's price: nothing pays 2 tokens a row, everything
    pays 0 (then trees fill `tree_rows`)."""
    target, draft = pair
    drafted = {}
    for price in (None, 2.0, 0.0):
        engine = make_engine(target, draft, spec_tree="auto", adaptive_k=True, num_speculative_tokens=4,
                             tree_rows=6, num_blocks=128)
        assert engine.proposer.tree and engine.planner.priced_trees
        if price is not None:
            engine.policy.node_gain = lambda *a, price=price: price
            engine.policy.best_k = lambda rates, caps, *a, **kw: max(caps, default=0)  # always draft
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        assert all(u["used"] == 0 for u in engine.kv_usage().values())
        drafted[price] = engine.stats.num_draft_tokens
    assert drafted[2.0] == 0 < drafted[0.0]


def test_priced_draft_trees_roll_the_draft_cache_back(pair):
    target, _ = pair
    engine = make_engine(target, target, spec_tree="auto", adaptive_k=True, num_speculative_tokens=5,
                         tree_rows=10, num_blocks=128, enable_prefix_caching=False)
    engine.add_request(PROMPTS[2], GREEDY)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert _draft_kv_is_a_fresh_prefills(engine, seq)
    assert engine.stats.num_accepted_tokens > 0


def test_spec_tree_settings_are_checked():
    from specdec.config import EngineConfig

    with pytest.raises(ValueError, match="spec_tree"):
        EngineConfig(spec_tree="wide")
    with pytest.raises(ValueError, match="draft model's trees"):
        EngineConfig(spec_tree="on", proposer="ngram", draft=None)
    assert not EngineConfig(spec_tree="auto", adaptive_k=False).draft_trees  # priced trees need the policy
    assert not EngineConfig(spec_tree="auto", tensor_parallel_size=2).draft_trees
    with pytest.raises(ValueError, match="one-process target"):
        EngineConfig(spec_tree="on", tensor_parallel_size=2)
