"""Prefix caching and chunked prefill change what is computed, never what comes out.

Greedy outputs with and without either equal target-only decoding without either, for prompts
that share prefixes and diverge mid-block, speculative and not; cached tokens are reported; the
draft's pool caches too; eviction, aborts of sharing requests, preemption and fp8 KV stay exact.
"""

import pytest

from specdec.sampling_params import SamplingParams
from specdec.step.scheduler import MIN_PREFILL_CHUNK

from .conftest import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BASE = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
# block_size 4: these share 9, 13 and 22 tokens with BASE (mid-block divergence) and each other
SHARING = [BASE, BASE[:9] + [60, 61, 62, 63, 64, 65], BASE[:13] + [70, 71], BASE + [80, 81, 82]]


def outputs(engine, prompts, params=GREEDY):
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(pair):
    target, _ = pair
    engine = make_engine(target, enable_prefix_caching=False, max_prefill_chunk=4096)
    return {tuple(p): outputs(engine, [p])[0] for p in SHARING}


def expected(reference, prompts):
    return [reference[tuple(p)] for p in prompts]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("chunk", [3, 8, 4096])
@pytest.mark.parametrize("caching", [False, True])
def test_outputs_do_not_depend_on_caching_or_chunking(pair, reference, speculative, chunk, caching):
    target, draft = pair
    engine = make_engine(
        target, draft if speculative else None, num_speculative_tokens=3,
        enable_prefix_caching=caching, max_num_batched_tokens=chunk, max_prefill_chunk=chunk,
    )
    assert outputs(engine, SHARING) == expected(reference, SHARING)  # one batch: shares within it
    for prompt in SHARING[::-1]:  # one at a time: reuses what earlier requests left
        assert outputs(engine, [prompt]) == expected(reference, [prompt])
    hits = engine.target.pool.stats.hit_tokens
    assert (hits > 0) == caching


def test_repeated_prompt_reports_its_cached_tokens_in_both_pools(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    first = engine.generate([BASE], GREEDY)[0]
    assert first.num_cached_tokens == 0
    engine.add_request(BASE, GREEDY, request_id="again")
    seq = engine._sequences["again"]
    engine.step()
    # 22 tokens, blocks of 4: 5 full blocks before the last token, which is always recomputed
    assert seq.num_cached_tokens == 20 and seq.num_draft_cached_tokens == 20
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert deltas and all(d.num_cached_tokens == 20 for d in deltas)
    stats = engine.prefix_cache_stats()
    assert stats["target"]["hit_tokens"] == 20 and stats["draft"]["hit_tokens"] == 20


def test_next_turn_reuses_the_generated_answer(pair, reference):
    """A chat's next turn resends prompt + answer + more: the answer's blocks are cached too."""
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    answer = outputs(engine, [BASE])[0]
    turn2 = BASE + answer + [30, 31, 32]
    out = engine.generate([turn2], GREEDY)[0]
    assert out.num_cached_tokens >= len(BASE) + len(answer) - 4 - 1  # all but a partial block
    plain = make_engine(target, enable_prefix_caching=False)
    assert out.token_ids == outputs(plain, [turn2])[0]


def test_salted_requests_share_nothing(pair):
    target, _ = pair
    engine = make_engine(target)
    engine.generate([BASE], GREEDY)
    rid = engine.add_request(BASE, GREEDY, cache_salt="tenant-b")
    engine.step()
    assert engine._sequences[rid].num_cached_tokens == 0


def test_eviction_under_memory_pressure_stays_exact(pair, reference):
    """A pool that can hold one request at a time evicts cached blocks to admit the next."""
    target, draft = pair
    engine = make_engine(target, draft, num_blocks=12, num_speculative_tokens=3)
    for prompt in SHARING + SHARING:
        assert outputs(engine, [prompt]) == expected(reference, [prompt])
        pool = engine.target.pool
        assert pool.num_used == 0 and pool.num_cached > 0
    assert engine.target.pool.stats.hit_tokens > 0


def test_abort_of_a_request_whose_blocks_are_shared(pair, reference):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    outputs(engine, [BASE])  # cache BASE's blocks
    a = engine.add_request(SHARING[3], GREEDY)
    b = engine.add_request(SHARING[2], GREEDY)
    engine.step()
    shared = engine._sequences[a].target_table.block_ids[0]
    assert engine.target.pool.ref_count(shared) == 2
    engine.abort(a)
    assert engine.target.pool.ref_count(shared) == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.output(engine._sequences[b]).token_ids == reference[tuple(SHARING[2])]
    assert engine.target.pool.num_used == 0


def test_preempted_sequence_recomputes_from_the_cache(pair, reference):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    rid = engine.add_request(BASE, GREEDY)
    seq = engine._sequences[rid]
    for _ in range(3):
        engine.step()
    hits = engine.target.pool.stats.hit_tokens
    engine.scheduler.preempt(seq)
    while engine.has_unfinished():
        engine.step()
    assert engine.target.pool.stats.hit_tokens >= hits + 20  # its own prompt blocks came back
    assert engine.output(seq).token_ids == reference[tuple(BASE)]


def test_fp8_kv_cache_with_prefix_caching(pair):
    target, draft = pair
    plain = make_engine(target, draft, kv_dtype="fp8", enable_prefix_caching=False)
    cached = make_engine(target, draft, kv_dtype="fp8")
    want = outputs(plain, SHARING)
    assert outputs(cached, SHARING) == want
    assert [outputs(cached, [p])[0] for p in SHARING] == want
    assert cached.target.pool.stats.hit_tokens > 0


def test_a_running_stream_keeps_decoding_while_a_long_prompt_is_chunked(pair, reference):
    """Budget 8, of which the stream's verify window takes 4: the long prompt is fed in chunks of
    the minimum size that ride with the running stream's steps."""
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3, max_num_batched_tokens=8,
                         enable_prefix_caching=False)
    rows = []
    forward = engine.target.forward
    engine.target.forward = lambda windows: rows.append(sum(len(w.token_ids) for w in windows)) or forward(windows)
    runner = engine.add_request([40, 41, 42], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.step()  # its prefill
    long_prompt = SHARING[3] * 2  # 50 tokens
    late = engine.add_request(long_prompt, GREEDY)
    rows.clear()
    steps_until_first_token = 0
    while not engine._sequences[late].num_generated:
        deltas = engine.step()
        steps_until_first_token += 1
        assert any(d.request_id == runner and d.token_ids for d in deltas), "the running stream stalled"
    assert steps_until_first_token == -(-50 // MIN_PREFILL_CHUNK)
    assert max(rows) <= 4 + MIN_PREFILL_CHUNK  # a verify window and the minimum chunk
    while engine.has_unfinished():
        engine.step()
    plain = make_engine(target, enable_prefix_caching=False)
    assert engine.output(engine._sequences[late]).token_ids == outputs(plain, [long_prompt])[0]


def test_a_lagging_draft_cache_catches_up_in_chunks(pair):
    """After many steps without drafting the draft cache lags far behind; it is fed in chunks
    beside the steps (no drafting meanwhile), never in one forward that would stall the stream."""
    from specdec.step.planner import MAX_CATCH_UP, MAX_LONE_CATCH_UP

    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3, adaptive_k=True, draft_stop_confidence=0.0)
    drafting = {"on": False}
    engine.policy.best_k = lambda rates, caps, lags=None, ratio=None: max(caps) if drafting["on"] else 0
    rows = []
    forward = engine.proposer.runner.forward
    engine.proposer.runner.forward = lambda windows: rows.append(sum(len(w.token_ids) for w in windows)) or forward(windows)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    rid = engine.add_request([40, 41, 42], params)
    engine.add_request([50, 51], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(110):
        engine.step()
    seq = engine._sequences[rid]
    assert seq.num_tokens - seq.draft_table.num_computed > 3 * MAX_CATCH_UP  # lagging far behind
    rows.clear()
    drafting["on"] = True
    while not seq.finished:
        engine.step()
    assert rows and max(rows) <= 2 * (MAX_CATCH_UP + 1) < MAX_LONE_CATCH_UP  # two streams catch up
    assert engine.stats.num_draft_tokens > 0  # it drafted once caught up
    plain = make_engine(target, enable_prefix_caching=False)
    assert engine.output(seq).token_ids == outputs(plain, [[40, 41, 42]], params)[0]
