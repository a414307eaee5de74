"""Block conservation with prefix sharing: any sequence of add / step / abort / preempt / failed
step keeps both pools consistent — every held block counted once per holder, shared blocks never written, a
drained engine holding nothing but evictable cached blocks."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.engine import StepError
from specdec.sampling_params import SamplingParams

from .conftest import make_engine

BASES = [list(range(3, 40)), list(range(50, 90))]  # prompts share prefixes of these, then diverge
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 1), st.integers(1, 20), st.integers(0, 4),
                  st.integers(1, 12), st.integers(0, 6)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("preempt"), st.integers(0, 30)),
        st.tuples(st.just("fail")),
    ),
    min_size=1,
    max_size=40,
)


def check_pools(engine) -> None:
    seqs = engine.scheduler.running + list(engine.scheduler.waiting)
    for name, pool in [("target", engine.target.pool), ("draft", engine.proposer.pool)]:
        tables = [t for s in seqs for t in [getattr(s, f"{name}_table")] if t is not None]
        holders = Counter(b for t in tables for b in t.block_ids)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert 0 <= pool.num_cached <= pool.num_free
        assert pool.num_used == len(holders), "a block leaked, or a held block is on the free list"
        for block_id, count in holders.items():
            assert pool.ref_count(block_id) == count, f"block {block_id}: refcount != holders"
        for t in tables:
            assert t.num_frozen_tokens <= t.num_computed
            for block_id in t.block_ids[len(t.block_keys):]:  # blocks still written to
                assert pool.ref_count(block_id) == 1, "a block is shared while it can be written"
    for s in engine.scheduler.waiting:
        assert s.target_table is None and s.draft_table is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, temperature=st.sampled_from([0.0, 1.0]), chunk=st.sampled_from([4, 64]))
def test_random_operations_conserve_blocks(pair, ops, temperature, chunk):
    target, draft = pair
    engine = make_engine(target, draft, num_blocks=14, block_size=2, max_num_seqs=4,
                         max_num_batched_tokens=chunk, max_prefill_chunk=chunk)
    ids = []
    for op in ops:
        if op[0] == "add":
            _, base, shared, tail, max_tokens, k = op
            prompt = BASES[base][:shared] + [90 + i for i in range(tail)] or [5]
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
            ids.append(engine.add_request(prompt, params, num_speculative_tokens=k))
        elif op[0] == "step":
            engine.step()
        elif op[0] == "abort" and ids:
            engine.abort(ids[op[1] % len(ids)])
        elif op[0] == "preempt" and engine.scheduler.running:
            running = engine.scheduler.running
            engine.scheduler.preempt(running[op[1] % len(running)])
        elif op[0] == "fail":
            fail_next_target_forward(engine)
        check_pools(engine)
    while engine.has_unfinished():
        engine.step()
        check_pools(engine)
    for pool in (engine.target.pool, engine.proposer.pool):
        assert pool.num_used == 0  # only evictable cached blocks are left
        assert pool.num_free == pool.num_blocks


def fail_next_target_forward(engine) -> None:
    """A step whose target forward raises (the draft's forwards of that step have run)."""

    def boom(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    engine.target.forward = boom
    try:
        engine.step()
    except StepError:
        pass
    finally:
        del engine.target.forward  # the class's forward again
