"""Losslessness: speculative sampling emits exactly the target's distribution.

Small vocabulary, position-dependent target tables p_t and draft tables q_t (independent of the
prefix, for simplicity), both warped by `warp_probs` with the same temperature / top-k / top-p.
Each simulation runs N = 200k sequences through the full procedure: draft n <= k tokens from q
autoregressively, verify with `rejection_sample`; if that step emitted only one token, the second
token comes from the next step, which starts at position 1. Then

  (a) the first emitted token must be distributed as p_0,
  (b) the first two emitted tokens jointly as p_0(x) * p_1(y).

Statistic: total variation distance between empirical and exact distributions. With N = 200k,
sampling noise gives TV ~0.003 over <= 8 cells and ~0.008 over <= 64 cells, so the bounds are
TV < 0.01 (first token) and TV < 0.02 (pairs). A negative control that samples from p instead of
norm(max(0, p - q)) after a rejection must exceed the same bounds.
"""

import pytest
import torch

from specdec.verify import rejection_sample, warp_probs

V = 8
K = 3
N = 200_000
TV_FIRST = 0.01
TV_PAIR = 0.02


def _tables(temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p [K+2, V] and draft q [K+1, V]: one row per absolute position."""
    gen = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(K + 2, V, generator=gen) * 1.5
    draft_logits = target_logits[: K + 1] + torch.randn(K + 1, V, generator=gen) * 1.5

    def warp(logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        return warp_probs(logits, torch.full((rows,), temperature),
                          torch.full((rows,), top_k), torch.full((rows,), top_p))

    return warp(target_logits), warp(draft_logits)


def _step(p: torch.Tensor, q: torch.Tensor, start: int, gen: torch.Generator,
          deterministic: bool, wrong: bool):
    """One verify step for N sequences at absolute position `start`; first two emitted tokens."""
    p_win, q_win = p[start : start + K + 1], q[start : start + K]  # [K+1, V], [K, V]
    num_draft = torch.randint(0, K + 1, (N,), generator=gen)  # [N], mixed widths and padding
    if deterministic:  # e.g. n-gram: a fixed guess per position
        drafts = q_win.argmax(dim=-1).expand(N, K).clone()  # [N, K]
    else:
        drafts = torch.multinomial(q_win, N, replacement=True, generator=gen).T.contiguous()
    drafts[torch.arange(K) >= num_draft.unsqueeze(1)] = -1
    out = rejection_sample(drafts, num_draft, None if deterministic else q_win.expand(N, K, V),
                           p_win.expand(N, K + 1, V), [None] * N)
    tokens, accepted = out.token_ids, out.num_accepted  # [N, K+1], [N]
    if wrong:  # after a rejection, sample from p instead of the residual
        rejected = accepted < num_draft
        redraw = torch.multinomial(p_win[accepted], 1, generator=gen).squeeze(1)  # [N]
        final = tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
        tokens = tokens.scatter(1, accepted.unsqueeze(1),
                                torch.where(rejected, redraw, final).unsqueeze(1))
    return tokens[:, 0], torch.where(accepted >= 1, tokens[:, 1], -1)


def _first_two_tokens(p, q, deterministic: bool = False, wrong: bool = False):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the sampler's unseeded rows use the default RNG
    first, second = _step(p, q, 0, gen, deterministic, wrong)
    next_step_first, _ = _step(p, q, 1, gen, deterministic, wrong)
    return first, torch.where(second >= 0, second, next_step_first)


def _tv(samples: torch.Tensor, expected: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=expected.numel()).float() / samples.numel()
    return 0.5 * (empirical - expected.flatten()).abs().sum().item()


def _distances(p, q, deterministic: bool = False, wrong: bool = False) -> tuple[float, float]:
    first, second = _first_two_tokens(p, q, deterministic, wrong)
    return _tv(first, p[0]), _tv(first * V + second, torch.outer(p[0], p[1]))


CONFIGS = [
    pytest.param(1.0, 0, 1.0, id="T1"),
    pytest.param(0.7, 0, 1.0, id="T0.7"),
    pytest.param(1.0, 4, 1.0, id="T1-topk4"),
    pytest.param(0.7, 0, 0.8, id="T0.7-topp0.8"),
    pytest.param(0.7, 5, 0.9, id="T0.7-topk5-topp0.9"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "no_draft_probs"])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CONFIGS)
def test_emitted_tokens_follow_the_target(temperature, top_k, top_p, deterministic) -> None:
    p, q = _tables(temperature, top_k, top_p)
    tv_first, tv_pair = _distances(p, q, deterministic)
    assert tv_first < TV_FIRST, f"first token TV {tv_first:.4f}"
    assert tv_pair < TV_PAIR, f"first-two-tokens TV {tv_pair:.4f}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "no_draft_probs"])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CONFIGS)
def test_negative_control_sampling_p_after_rejection_fails(temperature, top_k, top_p,
                                                           deterministic) -> None:
    p, q = _tables(temperature, top_k, top_p)
    tv_first, tv_pair = _distances(p, q, deterministic, wrong=True)
    assert tv_first > TV_FIRST and tv_pair > TV_PAIR, (tv_first, tv_pair)


def test_drafts_really_get_rejected_and_accepted() -> None:
    # The check above is only meaningful if both branches happen often.
    p, q = _tables(1.0, 0, 1.0)
    overlap = torch.minimum(p[:K], q[:K]).sum(dim=-1)  # acceptance rate per position
    assert ((overlap > 0.2) & (overlap < 0.8)).all(), overlap
