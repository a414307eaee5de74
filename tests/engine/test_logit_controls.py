"""Logit controls (penalties, logit_bias, min_p, min_tokens) and logprobs under speculation.

Greedy: speculative output with the controls equals target-only output with them, and matches a
reference written directly with transformers' logits. Logprobs: the same numbers whether a token
was an accepted draft, a recovered or a bonus token, or came from plain decoding, and equal to
transformers' log_softmax of the controlled logits. (Statistical losslessness with the controls:
tests/engine/test_losslessness.py.)
"""

import pytest
import torch

from specdec.sampling_params import SamplingParams
from specdec.sequence import TokenOrigin
from specdec.testing import from_hf, noisy_twin
from specdec.verify.controls import LogitControls, apply_controls
from specdec.verify.sampling import warp_probs

from .conftest import PROMPTS, make_engine

CONTROLS = dict(frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.3, logit_bias={7: 2.0, 9: -3.0})
LOGPROB_TOLERANCE = 1e-4  # fp32 tiny models; speculation changes which rows share a forward


# ---- apply_controls ----------------------------------------------------------------------------


def test_apply_controls_docstring_example():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.0]])
    c = LogitControls([1], frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=2.0)
    assert apply_controls(logits, [c], [[2]]).tolist() == [[1.0, 0.0, -3.0, 0.0]]


def test_each_row_counts_its_own_prefix():
    """Rows of one sequence differ only by the drafts before them, and so do their penalties."""
    c = LogitControls([3, 3], frequency_penalty=1.0)
    out = apply_controls(torch.zeros(3, 5), [c, c, c], [[], [1], [1, 3]])
    assert out.tolist() == [[0, 0, 0, -2, 0], [0, -1, 0, -2, 0], [0, -1, 0, -3, 0]]


def test_repetition_penalty_reaches_the_prompt_and_bias_adds():
    c = LogitControls([], prompt_ids=[0, 2], repetition_penalty=2.0, logit_bias={1: 5.0})
    out = apply_controls(torch.tensor([[4.0, 1.0, -2.0]]), [c], [[]])
    assert out.tolist() == [[2.0, 6.0, -4.0]]


def test_min_tokens_bans_stop_ids_until_reached():
    c = LogitControls([5], min_tokens=3, stop_ids=[0, 2])
    out = apply_controls(torch.zeros(3, 4), [c, c, c], [[], [1], [1, 1]])
    assert torch.isinf(out[0, [0, 2]]).all() and torch.isinf(out[1, [0, 2]]).all()
    assert torch.isfinite(out[2]).all()  # 1 emitted + 2 drafts before the row = 3


def test_rows_without_controls_are_untouched():
    logits = torch.randn(2, 6)
    assert apply_controls(logits, [None, None], [[], []]) is logits
    out = apply_controls(logits, [None, LogitControls([1], frequency_penalty=1.0)], [[], []])
    assert torch.equal(out[0], logits[0]) and out[1, 1] == logits[1, 1] - 1


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    probs = warp_probs(logits, one(1.0), one(0, torch.long), one(1.0), one(0.2))
    assert probs[0, 3] == 0 and probs[0, 2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


# ---- the engine ---------------------------------------------------------------------------------


def _reference_greedy(hf, prompt: list[int], params: SamplingParams, eos: set[int]) -> list[int]:
    """Greedy decoding with the controls, written directly over transformers' logits."""
    out: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1:].float()
        c = LogitControls(out, prompt, params.presence_penalty, params.frequency_penalty,
                          params.repetition_penalty, params.logit_bias, params.min_tokens, sorted(eos))
        out.append(int(apply_controls(logits, [c], [[]]).argmax()))
    return out


@pytest.mark.parametrize("k", [0, 2, 5])
def test_greedy_with_controls_equals_a_direct_reference(hf_target, k):
    target = from_hf(hf_target)
    engine = make_engine(target, target if k else None, num_speculative_tokens=k) if k else make_engine(target)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **CONTROLS)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        out = engine.generate([prompt], params)[0].token_ids
        assert out == _reference_greedy(hf_target, prompt, params, set())
        assert out != engine.generate([prompt], plain)[0].token_ids  # the controls did something


def test_greedy_with_controls_speculative_equals_target_only(pair):
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **CONTROLS)
    reference = [o.token_ids for o in make_engine(target).generate(PROMPTS, params)]
    for k in (1, 3, 6):
        engine = make_engine(target, draft, num_speculative_tokens=k)
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == reference
        assert 0 < engine.stats.acceptance_rate < 1


def test_logit_bias_makes_a_token_the_first_greedy_token(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    plain = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    forced = next(t for t in range(10, 40) if t != plain.token_ids[0])
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                        logit_bias={forced: 100.0}))[0]
    assert out.token_ids == [forced] * 4  # the bias holds for every row, drafts' included


def test_frequency_penalty_stops_repetition(pair):
    """A token the plain greedy answer repeats is repeated far less under a large penalty."""
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=4)
    prompt = [9] * 12
    base = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = engine.generate([prompt], base)[0].token_ids
    top = max(set(plain), key=plain.count)
    penalized = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                         frequency_penalty=2.0))[0].token_ids
    assert plain.count(top) >= 4
    assert penalized.count(top) < plain.count(top) and len(set(penalized)) > len(set(plain))


def test_min_tokens_holds_back_eos(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3)
    first = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    stop = first.token_ids[0]  # the token greedy would start with: a stop id until min_tokens
    out = engine.generate([PROMPTS[0]], SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=5, ignore_eos=True))[0]
    assert stop not in out.token_ids[:5]
    assert len(out.token_ids) >= 5


def test_out_of_vocabulary_controls_are_refused(pair):
    target, _ = pair
    engine = make_engine(target)
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(PROMPTS[0], SamplingParams(stop_token_ids=[vocab + 3]))


def _logprob_run(engine, params, prompt):
    origins, logprobs = [], []
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for d in engine.step():
            assert d.request_id == rid and len(d.logprobs) == len(d.token_ids)
            origins += d.origins
            logprobs += d.logprobs
    return origins, logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_target_only_and_transformers(hf_target, temperature):
    """Every emitted token's logprob (and the top alternatives) from the verify pass equals a
    target-only run's and transformers' log_softmax of the controlled logits / temperature."""
    target = from_hf(hf_target)
    draft = noisy_twin(target, sigma=0.02)
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=5, logprobs=3,
                            frequency_penalty=0.5, logit_bias={11: 1.0})
    prompt = PROMPTS[2]
    spec = make_engine(target, draft, num_speculative_tokens=4)
    origins, spec_lp = _logprob_run(spec, params, prompt)
    assert {TokenOrigin.ACCEPTED, TokenOrigin.RECOVERED} <= set(origins)
    tokens = [e.token_id for e in spec_lp]
    out = spec.generate([prompt], params)[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids == tokens

    plain_lp = None
    if temperature == 0:  # the same answer target-only: compare the numbers directly
        _, plain_lp = _logprob_run(make_engine(target), params, prompt)
        assert [e.token_id for e in plain_lp] == tokens
    for i, entry in enumerate(spec_lp):
        with torch.no_grad():
            logits = hf_target(torch.tensor([prompt + tokens[:i]])).logits[0, -1:].float()
        c = LogitControls(tokens[:i], prompt, frequency_penalty=0.5, logit_bias={11: 1.0})
        ref = torch.log_softmax(apply_controls(logits, [c], [[]])[0] / (temperature or 1.0), -1)
        assert abs(entry.logprob - ref[entry.token_id].item()) < LOGPROB_TOLERANCE
        ref_top = ref.topk(3)
        assert [t for t, _ in entry.top] == ref_top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(entry.top, ref_top.values.tolist())) < LOGPROB_TOLERANCE
        if plain_lp is not None:
            assert abs(entry.logprob - plain_lp[i].logprob) < LOGPROB_TOLERANCE


def test_no_logprobs_unless_asked(pair):
    target, draft = pair
    out = make_engine(target, draft, num_speculative_tokens=3).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.logprobs is None
    zero = make_engine(target, draft, num_speculative_tokens=3).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0))[0]
    assert len(zero.logprobs) == 5 and all(e.top == [] for e in zero.logprobs)


def test_logprobs_stop_with_the_emitted_tokens(pair):
    """A stop token cuts the step's tokens; the logprobs stay aligned with what was emitted."""
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=5)
    full = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = full.token_ids[6]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        stop_token_ids=[stop], logprobs=1))[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]


# ---- n > 1: siblings share the prompt's blocks ------------------------------------------------------


def test_siblings_wait_for_the_prompt_and_reuse_its_blocks(pair):
    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=3, num_blocks=128)
    prompt = list(range(10, 40))  # 30 tokens: 7 full blocks of 4
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    first = engine.add_request(prompt, params[0])
    others = [engine.add_request(prompt, p, share_prompt_with=first) for p in params[1:]]
    scheduled = engine.scheduler.schedule  # record who each step admits
    steps = []
    engine.scheduler.schedule = lambda: (r := scheduled(), steps.append({s.request_id for s in r}))[0]
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            results.setdefault(d.request_id, []).extend(d.token_ids)
    assert steps[0] == {first}  # the siblings wait while the prompt is computed
    cached = {rid: engine._sequences[rid].num_cached_tokens for rid in others}
    assert all(n == 28 for n in cached.values()), cached  # every full block but the last token's
    alone = make_engine(target, draft, num_speculative_tokens=3).generate([prompt], params[1])[0].token_ids
    assert results[others[0]] == alone  # a seeded sibling samples what it would alone
    assert len({tuple(v) for v in results.values()}) == 3


def test_share_prompt_with_an_unknown_request_is_refused(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="share_prompt_with"):
        make_engine(target).add_request(PROMPTS[0], share_prompt_with="nope")


# ---- the structured-output hook: a constraint sees each row's own prefix -------------------------


class _Alternating:
    """A toy grammar: after an even token only odd tokens, after an odd one only even tokens."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.committed: list[int] = []

    def allowed(self, extra, vocab):
        last = extra[-1] if extra else (self.committed[-1] if self.committed else self.last)
        return torch.arange(vocab) % 2 != last % 2

    def commit(self, token_ids):
        self.committed += list(token_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_holds_on_every_row_and_greedy_equals_target_only(pair, temperature):
    target, _ = pair
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3)

    def run(engine):
        rid = engine.add_request(PROMPTS[0], params)
        seq = engine._sequences[rid]
        seq.constraint = _Alternating(PROMPTS[0][-1])
        tokens = []
        while engine.has_unfinished():
            for d in engine.step():
                tokens += d.token_ids
        assert seq.constraint.committed == tokens
        return tokens

    spec = make_engine(target, noisy_twin(target, sigma=0.02), num_speculative_tokens=4)
    tokens = run(spec)
    sequence = PROMPTS[0][-1:] + tokens
    assert all((a + b) % 2 == 1 for a, b in zip(sequence, sequence[1:]))
    assert spec.stats.num_accepted_tokens > 0
    if temperature == 0:
        assert tokens == run(make_engine(target))
