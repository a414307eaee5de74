"""A step that raises releases every request it ran: blocks back in both pools, nothing left
registered, and the engine keeps generating exactly as before."""

import pytest

from specdec.engine import StepError
from specdec.sampling_params import SamplingParams

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class FailOnCall:
    """Wraps a runner's `forward` so that its `n`-th call raises `error` (once)."""

    def __init__(self, runner, n: int, error: BaseException | None = None) -> None:
        self.forward, self.n, self.calls = runner.forward, n, 0
        self.error = error or RuntimeError("simulated device failure")
        runner.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise self.error
        return self.forward(*args, **kwargs)


def assert_released(engine) -> None:
    for pool in engine._pools().values():
        assert pool.num_free == pool.num_blocks and pool.num_used == 0
    assert not engine._sequences and not engine.has_unfinished()


@pytest.fixture(scope="module")
def reference(pair):
    target, draft = pair
    return [o.token_ids for o in make_engine(target, draft, num_speculative_tokens=3).generate(PROMPTS[:2], GREEDY)]


@pytest.mark.parametrize("model, n", [("target", 4), ("target", 1), ("draft", 3)])
def test_generate_releases_everything_when_a_step_fails(pair, reference, model, n):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    runner = engine.target if model == "target" else engine.proposer.runner
    FailOnCall(runner, n)
    with pytest.raises(StepError, match="simulated device failure") as info:
        engine.generate(PROMPTS[:2], GREEDY)
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.request_ids
    assert_released(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], GREEDY)] == reference
    assert_released(engine)


def test_stream_releases_everything_when_a_step_fails(pair, reference):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    FailOnCall(engine.target, 3)
    seen = []
    with pytest.raises(StepError):
        for delta in engine.stream(PROMPTS[:2], GREEDY):
            seen.append(delta)
    assert seen, "tokens came before the failure"
    assert_released(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], GREEDY)] == reference


def test_a_bad_prompt_in_generate_leaves_nothing_behind(pair):
    target, draft = pair
    engine = make_engine(target, draft)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([PROMPTS[0], []], GREEDY)
    assert_released(engine)


def test_a_failed_step_fails_only_the_requests_it_ran(pair, reference):
    """Requests still waiting (max_num_seqs) are untouched and finish exactly."""
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3, max_num_seqs=1)
    first = engine.add_request(PROMPTS[2], GREEDY)
    others = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    engine.step()
    FailOnCall(engine.target, 1)
    with pytest.raises(StepError) as info:
        engine.step()
    assert info.value.request_ids == [first]
    assert not engine.abort(first), "the failed request is already forgotten"
    tokens = {rid: [] for rid in others}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    assert [tokens[rid] for rid in others] == reference
    for rid in others:
        engine.release(rid)
    assert_released(engine)


def test_keyboard_interrupt_in_a_step_releases_its_requests_and_stays_itself(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    FailOnCall(engine.target, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[:2], GREEDY)
    assert_released(engine)


def test_from_models_refuses_models_off_the_configured_device(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="config.device is 'meta' but the target model is on cpu"):
        make_engine(target, draft, device="meta")
    assert make_engine(target, draft, device="cpu").device.type == "cpu"
