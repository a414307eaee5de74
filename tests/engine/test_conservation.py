"""Block conservation: any sequence of add / step / abort / preempt leaves both pools consistent."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.sampling_params import SamplingParams

from .conftest import make_engine

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 12), st.integers(0, 6)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=40,
)


def _check_pools(engine) -> None:
    seqs = engine.scheduler.running + list(engine.scheduler.waiting)
    for name, pool in [("target", engine.target.pool), ("draft", engine.proposer.pool)]:
        assert pool.num_free + pool.num_used == pool.num_blocks
        owned = [b for s in seqs for t in [getattr(s, f"{name}_table")] if t for b in t.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) == pool.num_used, "a block leaked or was double counted"
    for s in engine.scheduler.waiting:
        assert s.target_table is None and s.draft_table is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, temperature=st.sampled_from([0.0, 1.0]))
def test_random_operations_conserve_blocks(pair, ops, temperature):
    target, draft = pair
    engine = make_engine(target, draft, num_blocks=12, block_size=2, max_num_seqs=4)
    ids = []
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, k = op
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
            ids.append(engine.add_request(list(range(3, 3 + plen)), params, num_speculative_tokens=k))
        elif op[0] == "step":
            engine.step()
        elif ids:
            engine.abort(ids[op[1] % len(ids)])
        _check_pools(engine)
    while engine.has_unfinished():
        engine.step()
        _check_pools(engine)
    assert engine.target.pool.num_used == 0
    assert engine.proposer.pool.num_used == 0
