"""End to end through the engine: speculative sampling emits the target's distribution.

Tiny models over an 8-token vocabulary; 4000 requests of the same prompt run batched. The first two
emitted tokens come from the first speculative step (k=3), so they exercise acceptance, the
recovered token and the bonus token. Their empirical joint distribution must match the exact
target distribution p(x1) p(x2 | x1), computed with transformers' forward, within a total-variation
tolerance that a wrong sampler exceeds (see tests/verify for the negative control).
"""

import pytest
import torch

from specdec.engine import Engine
from specdec.sampling_params import SamplingParams, StructuredSpec
from specdec.structured import GrammarConstraint, GrammarCompiler
from specdec.testing import from_hf, tiny_hf_model
from specdec.draft import SamplingTensors
from specdec.verify import warp_probs
from specdec.verify.controls import LogitControls, apply_controls

from .conftest import make_engine

V = 8
PROMPT = [3, 5, 1]
N = 4000
TV_TOLERANCE = 0.05  # sampling noise for 64 outcomes at N=4000 is about 0.025
# Penalties strong enough that a row which does not count the drafts before it is far off.
CONTROLS = dict(frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5, logit_bias={2: 1.0}, min_p=0.05)


def _exact_joint(hf, params: SamplingParams) -> torch.Tensor:
    def dist(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1:]
        controls = LogitControls(
            ids[len(PROMPT) :], PROMPT, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.logit_bias,
        )
        logits = apply_controls(logits, [controls], [[]])
        one = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
        return warp_probs(logits, one(params.temperature, torch.float32), one(params.top_k, torch.long),
                          one(params.top_p, torch.float32), one(params.min_p, torch.float32))[0]

    p1 = dist(PROMPT)
    return torch.stack([p1[x] * dist(PROMPT + [x]) for x in range(V)])  # [V, V]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, **CONTROLS),
    ],
    ids=["t1.0", "t0.7-topk-topp", "t1.0-penalties-bias-minp"],
)
def test_engine_output_distribution_is_the_targets(params):
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    engine = make_engine(from_hf(hf_target), from_hf(hf_draft), num_speculative_tokens=3,
                         max_num_seqs=N, num_blocks=3 * N, block_size=4)
    torch.manual_seed(0)
    outs = engine.generate([PROMPT] * N, params)
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    empirical = counts / N
    exact = _exact_joint(hf_target, params)
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert 0.02 < engine.stats.acceptance_rate < 0.98  # drafts are both accepted and rejected


def test_controls_that_ignore_the_drafts_before_a_row_are_caught(monkeypatch):
    """Negative control for the penalized case: if every row's penalties counted only the
    committed tokens (not the drafts before the row), the second token would come from an
    unpenalized distribution whenever the first was an accepted draft. With a draft equal to the
    target every first token is accepted, so repeats (x2 == x1), which the penalties make rare,
    become far more frequent than the exact distribution allows (the standard error of that
    frequency at N = 4000 is below 0.008)."""
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, **CONTROLS)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    exact_repeats = _exact_joint(hf_target, params).diagonal().sum().item()

    def repeats() -> float:
        target = from_hf(hf_target)
        engine = make_engine(target, target, num_speculative_tokens=3, max_num_seqs=N, num_blocks=3 * N, block_size=4)
        torch.manual_seed(0)
        return sum(o.token_ids[0] == o.token_ids[1] for o in engine.generate([PROMPT] * N, params)) / N

    assert abs(repeats() - exact_repeats) < 0.03
    controlled = SamplingTensors.controlled
    monkeypatch.setattr(SamplingTensors, "controlled", lambda self, logits, owners, extra: controlled(
        self, logits, owners, [[] for _ in extra]))
    wrong = repeats()
    assert wrong - exact_repeats > 0.06, (wrong, exact_repeats)


def test_hybrid_proposer_output_distribution_is_the_targets():
    """Prompt-lookup rows (q one-hot) and draft-model rows verified together stay lossless.

    The prompt ends with a repeated 3-gram (and bigram), so the speculative step (the second token) uses prompt
    lookup whenever the first token continues the repeat, and the draft model otherwise.
    """
    global PROMPT
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    saved, PROMPT = PROMPT, [3, 5, 1, 2, 3, 5, 1]
    try:
        engine = make_engine(from_hf(hf_target), from_hf(hf_draft), proposer="hybrid",
                             num_speculative_tokens=3, max_num_seqs=N, num_blocks=3 * N, block_size=4)
        lookups = []
        lookup = engine.proposer.ngram.lookup
        engine.proposer.ngram.lookup = lambda tokens, k: lookups.append(bool(r := lookup(tokens, k))) or r
        torch.manual_seed(0)
        outs = engine.generate([PROMPT] * N, params)
        counts = torch.zeros(V, V)
        for o in outs:
            counts[o.token_ids[0], o.token_ids[1]] += 1
        tv = 0.5 * (counts / N - _exact_joint(hf_target, params)).abs().sum().item()
    finally:
        PROMPT = saved
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert 0.02 < sum(lookups) / len(lookups) < 0.98  # both kinds of rows were verified


def _second_third_tv(outs, hf_target) -> float:
    """Total variation between the outputs' joint of tokens 2 and 3 and the target's exact joint
    (marginalized over token 1, which the prefill samples)."""
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1

    def dist(ids):
        with torch.no_grad():
            return torch.softmax(hf_target(torch.tensor([ids])).logits[0, -1].float(), -1)

    p1 = dist(PROMPT)
    exact = sum(p1[x] * torch.stack([dist(PROMPT + [x])[y] * dist(PROMPT + [x, y]) for y in range(V)])
                for x in range(V))
    return 0.5 * (counts / N - exact).abs().sum().item()


def test_early_stopped_drafts_keep_the_output_distribution_the_targets():
    """Drafting that stops once the draft's confidence drops stays lossless.

    The speculative step (the second token on) may draft 2 tokens (max_tokens caps it) but stops
    after a first draft whose probability falls below 0.3, so the third token comes from a stopped
    draft's bonus or recovered token about as often as from a second draft. The marginal of tokens
    2 and 3 must be exact.
    """
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    engine = make_engine(from_hf(hf_target), from_hf(hf_draft), num_speculative_tokens=3,
                         max_num_seqs=N, num_blocks=3 * N, block_size=4)
    engine.proposer.stop_below = 0.3
    drafted = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda *a, **kw: (out := propose(*a, **kw), drafted.extend(out.num_draft))[0]
    torch.manual_seed(0)
    tv = _second_third_tv(engine.generate([PROMPT] * N, params), hf_target)
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    drafted = [n for n in drafted if n]
    stopped = sum(n == 1 for n in drafted) / len(drafted)
    assert 0.05 < stopped < 0.95, stopped  # drafts both stopped early and ran to the cap


# ---- structured output: a grammar over the 8-token vocabulary -------------------------------------
# Tokens 0..7 are the bytes a b <eos> d e f g h (2 is the tiny models' EOS). The grammar: the first
# two tokens alternate parity (odd-even or even-odd), then two more tokens, then EOS. What the second
# token may be depends on the first, so a row masked without the drafts before it is wrong.
GRAMMAR = StructuredSpec.regex("([bdfh][aeg]|[aeg][bdfh])[abdefgh]{2}")


class _ToyTokenizer:
    eos_token_id = 2
    bos_token_id = None
    tokens = [b"a", b"b", b"<eos>", b"d", b"e", b"f", b"g", b"h"]
    special_token_ids = [2]

    def __call__(self, text):
        data = text if isinstance(text, bytes) else text.encode()
        return [self.tokens.index(bytes([c])) for c in data]


def _toy_grammars() -> GrammarCompiler:
    import llguidance

    return GrammarCompiler(None, V, [2], ll_tokenizer=llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ToyTokenizer())))


def _grammar_joint(hf) -> torch.Tensor:
    grammars = _toy_grammars()

    def dist(ids):
        constraint = grammars.constraint(GRAMMAR)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        logits = logits.masked_fill(~constraint.allowed(ids[len(PROMPT):], V), float("-inf"))
        return torch.softmax(logits, -1)

    p1 = dist(PROMPT)
    return torch.stack([p1[x] * dist(PROMPT + [x]) for x in range(V)])  # [V, V]


def _grammar_run(draft_seed: int | None, max_tokens: int = 8) -> tuple[torch.Tensor, Engine]:
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    target = from_hf(hf_target)
    draft = target if draft_seed is None else from_hf(tiny_hf_model("llama", seed=draft_seed, vocab_size=V, num_hidden_layers=1))
    engine = make_engine(target, draft, num_speculative_tokens=3, max_num_seqs=N, num_blocks=3 * N, block_size=4)
    engine._grammars = _toy_grammars()
    torch.manual_seed(0)
    outs = engine.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=max_tokens, structured=GRAMMAR))
    counts = torch.zeros(V, V)
    for o in outs:
        assert len(o.token_ids) == min(4, max_tokens) and (o.finish_reason == "stop" or max_tokens <= 4)
        counts[o.token_ids[0], o.token_ids[1]] += 1
    return counts / N, engine


def test_grammar_constrained_output_distribution_is_the_targets_restricted_to_the_grammar():
    empirical, engine = _grammar_run(draft_seed=4)
    exact = _grammar_joint(tiny_hf_model("llama", seed=3, vocab_size=V))
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert 0.02 < engine.stats.acceptance_rate < 0.98


def test_a_grammar_not_advanced_along_the_drafts_is_caught(monkeypatch):
    """Negative control: every row masked with the committed tokens' mask (the grammar state not
    advanced along the drafts before the row, the bug peers have had) lets an accepted first draft
    be followed by a token of the same parity, which the grammar forbids: the joint is far off.
    (Two tokens only, both from the first speculative step: committing such a pair raises.)"""
    exact = _grammar_joint(tiny_hf_model("llama", seed=3, vocab_size=V))
    right, _ = _grammar_run(draft_seed=None, max_tokens=2)
    assert 0.5 * (right - exact).abs().sum().item() < TV_TOLERANCE  # the same run, unbroken, is exact
    allowed = GrammarConstraint.allowed
    monkeypatch.setattr(GrammarConstraint, "allowed", lambda self, extra, vocab: allowed(self, [], vocab))
    monkeypatch.setattr(GrammarConstraint, "commit", lambda self, token_ids: self._masks.clear())
    empirical, _ = _grammar_run(draft_seed=None, max_tokens=2)
    same_parity = sum(empirical[a, b].item() for a in range(V) for b in range(V) if (a + b) % 2 == 0)
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert same_parity > 0.1 and tv > 0.15, (same_parity, tv)


def test_grammar_forced_drafts_keep_the_output_distribution_exact():
    """A grammar that forces the second token (a after an odd first token, b after an even one):
    the draft proposer proposes it itself (q one-hot) and drafts the third token from a window
    that feeds both. The joint of the first and third tokens must be the target's under the
    grammar, and the forced token must have been proposed by the grammar."""
    spec = StructuredSpec.regex("([bdfh]a|[aeg]b)[abdefgh]{2}")
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    grammars = _toy_grammars()

    def dist(ids):
        constraint = grammars.constraint(spec)
        with torch.no_grad():
            logits = hf_target(torch.tensor([ids])).logits[0, -1].float()
        return torch.softmax(logits.masked_fill(~constraint.allowed(ids[len(PROMPT):], V), float("-inf")), -1)

    p1 = dist(PROMPT)
    exact = torch.stack([p1[x] * dist(PROMPT + [x, 0 if x % 2 else 1]) for x in range(V)])  # [V, V]: x1, x3
    draft = from_hf(tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1))
    engine = make_engine(from_hf(hf_target), draft, num_speculative_tokens=3, max_num_seqs=N,
                         num_blocks=3 * N, block_size=4)
    engine._grammars = grammars
    torch.manual_seed(0)
    outs = engine.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=8, structured=spec))
    counts = torch.zeros(V, V)
    for o in outs:
        assert o.token_ids[1] == (0 if o.token_ids[0] % 2 else 1)
        counts[o.token_ids[0], o.token_ids[2]] += 1
    tv = 0.5 * (counts / N - exact).abs().sum().item()
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert engine.proposer.num_forced >= N  # the second token's draft came from the grammar


def test_a_draft_head_over_part_of_the_vocabulary_keeps_the_output_distribution_the_targets():
    """FR-Spec (`draft.vocab`): the draft's LM head keeps 4 of the 8 ids, so its q is zero on the
    other 4, which the target still emits through the residual. The joint of the first two tokens
    (the first speculative step's acceptances, recoveries and bonus tokens) must be exact, and every
    draft must come from the kept ids."""
    from specdec.draft.vocab import restrict_head

    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    draft = from_hf(hf_draft)
    kept = torch.tensor([0, 3, 4, 6])
    restrict_head(draft, kept)
    engine = make_engine(from_hf(hf_target), draft, num_speculative_tokens=3,
                         max_num_seqs=N, num_blocks=3 * N, block_size=4)
    drafted = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda *a, **kw: (out := propose(*a, **kw), drafted.append(out.token_ids))[0]
    torch.manual_seed(0)
    outs = engine.generate([PROMPT] * N, params)
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    tv = 0.5 * (counts / N - _exact_joint(hf_target, params)).abs().sum().item()
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    proposed = torch.cat([t[t >= 0] for t in drafted])
    assert proposed.numel() and torch.isin(proposed, kept).all()
    assert counts[:, [1, 2, 5, 7]].sum() > 0  # ids the draft cannot propose are still emitted
    assert 0.02 < engine.stats.acceptance_rate < 0.98


def test_token_tree_output_distribution_is_the_targets():
    """Draft-free token trees (`proposer="recycling"`), verified by multi-candidate rejection
    sampling, stay lossless at T = 1: the table is seeded so every root has four candidates (a
    tree of 6 nodes, 3 deep), and the joint of the 2nd and 3rd tokens (the first tree step's,
    the 1st comes from the prefill) matches the target's, marginalized over the 1st."""
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    engine = make_engine(from_hf(hf_target), proposer="recycling", num_speculative_tokens=3, tree_rows=6,
                         max_num_seqs=N, num_blocks=4 * N, block_size=4)
    engine.proposer.table.update(list(range(V)), [[(t + d) % V for d in (1, 2, 3, 5)] for t in range(V)])
    seen = []
    observe = engine.proposer.observe
    engine.proposer.observe = lambda seqs, draft, *a: seen.append(draft.parents is not None and any(
        p is not None and len(set(p)) < len(p) for p in draft.parents)) or observe(seqs, draft, *a)
    torch.manual_seed(0)
    tv = _second_third_tv(engine.generate([PROMPT] * N, params), hf_target)
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert any(seen)  # trees with siblings were verified
    assert 0.02 < engine.stats.num_accepted_tokens / max(1, engine.stats.num_draft_tokens) < 0.98
    assert all(u["used"] == 0 for u in engine.kv_usage().values())


def test_draft_model_trees_keep_the_output_distribution_the_targets():
    """The draft model's token trees (`spec_tree="on"`: the nodes of highest draft path
    probability, deterministic proposals) verified by multi-candidate rejection sampling stay
    lossless at T = 1; trees with siblings were verified and the draft's cache rolled back."""
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    engine = make_engine(from_hf(hf_target), from_hf(hf_draft), spec_tree="on", num_speculative_tokens=3,
                         tree_rows=6, max_num_seqs=N, num_blocks=4 * N, block_size=4)
    siblings = []
    keep = engine.proposer.keep_tree_path
    engine.proposer.keep_tree_path = lambda row, seq, path: siblings.append(
        len(set(engine.proposer.trees[row].parents)) < len(engine.proposer.trees[row].parents)) or keep(row, seq, path)
    torch.manual_seed(0)
    tv = _second_third_tv(engine.generate([PROMPT] * N, params), hf_target)
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert any(siblings)
    assert 0.02 < engine.stats.num_accepted_tokens / max(1, engine.stats.num_draft_tokens) < 0.98
    assert all(u["used"] == 0 for u in engine.kv_usage().values())
