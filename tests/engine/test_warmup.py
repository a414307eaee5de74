"""Warm-up leaves the engine as a fresh one would be, only warm: nothing held, counters at zero,
the same outputs; and it actually ran the shapes a request uses."""

import pytest

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.testing import tiny_engine_parts
from specdec.warmup import PASSES, WARMUP_TOKENS, warm_up, warmup_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def parts():
    return tiny_engine_parts()


def build(parts, **overrides) -> Engine:
    target, draft, tokenizer = parts
    config = EngineConfig(dtype="float32", num_blocks=128, block_size=4, **overrides)
    return Engine.from_models(config, target, draft, tokenizer)


def test_warm_up_holds_nothing_and_resets_counters(parts):
    engine = build(parts)
    forwards = []
    original = engine.target.forward
    engine.target.forward = lambda windows: forwards.append([len(w.token_ids) for w in windows]) or original(windows)
    report = warm_up(engine)
    assert report.num_passes == len(PASSES) and report.num_tokens == len(PASSES) * WARMUP_TOKENS
    assert not engine.has_unfinished() and not engine._sequences
    for pool in engine._pools().values():
        assert pool.num_free == pool.num_blocks  # cached blocks count as free
        assert pool.stats.queried_tokens == pool.stats.hit_tokens == 0
    assert engine.stats.num_draft_tokens == 0
    prompt_len = len(warmup_prompt(engine))
    windows = [n for step in forwards for n in step]
    assert windows[0] == prompt_len  # the prefill, in one forward
    assert 1 in windows  # a one-row decode step
    assert max(n for n in windows[1:]) > 1  # a verify window with drafts


def test_outputs_after_warm_up_equal_a_cold_engine(parts):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 30, 31]]
    cold = [o.token_ids for o in build(parts).generate(prompts, GREEDY)]
    warm_engine = build(parts)
    warm_up(warm_engine)
    assert [o.token_ids for o in warm_engine.generate(prompts, GREEDY)] == cold


def test_warm_up_without_a_tokenizer_or_a_draft(parts):
    target, _, _ = parts
    engine = Engine.from_models(
        EngineConfig(dtype="float32", num_blocks=64, block_size=4, proposer="none"), target,
    )
    assert warm_up(engine).num_tokens == len(PASSES) * WARMUP_TOKENS


def test_warm_up_refuses_a_busy_engine(parts):
    engine = build(parts)
    engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(engine)
