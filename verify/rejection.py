"""Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), vectorized.

Vocabulary, used everywhere in specdec:

- **accepted** tokens: draft tokens d_i kept because u_i < p_i(d_i) / q_i(d_i) held for them
  and for every draft before them;
- **recovered** token: at the first rejected position i, a token sampled from the residual
  norm(max(0, p_i - q_i)) in place of d_i;
- **bonus** token: when all n drafts are accepted, one more token sampled from p_n, the target's
  distribution after the last draft.

Each verify step emits the accepted tokens plus exactly one recovered or bonus token, and the
emitted tokens are distributed exactly as sampling the target alone would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.verify.sampling import sample


@dataclass
class VerifyOutput:
    """Result of one verify step for B sequences.

    `token_ids[b, :num_accepted[b] + 1]` are the emitted tokens (accepted drafts, then the
    recovered or bonus token); the rest of the row is -1. `paths[b]` (token trees): the window
    rows of row b's accepted drafts (a chain's: 1..num_accepted); None when every row is a chain.
    """

    token_ids: torch.Tensor  # [B, k+1] int64, padded with -1
    num_accepted: torch.Tensor  # [B] int64
    paths: list[list[int] | None] | None = None  # [B] accepted window rows of tree rows


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, k] int64, -1 past num_draft
    num_draft: torch.Tensor,  # [B] int64, 0..k
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    target_probs: torch.Tensor,  # [B, k+1, V]
    generators: list[torch.Generator | None],
    greedy: bool = False,
) -> VerifyOutput:
    """Keep the longest prefix of drafts the target agrees with, plus one token of its own.

    Row b has n = num_draft[b] drafts (n = 0 is plain decoding: one token from p_0). Draft i is
    accepted iff u_i * q_i(d_i) < p_i(d_i), u_i ~ U[0, 1): probability min(1, p/q), no division,
    and a token the target rules out (p = 0) is never accepted. At the first rejection i the
    recovered token is sampled from max(0, p_i - q_i) (from p_i should that be all zero); if all n
    are accepted the bonus token is sampled from p_n. `draft_probs=None` means a deterministic
    proposer: q_i is one-hot at d_i. With one-hot (greedy) p this is "accept while argmax p == d",
    then the target's argmax; `greedy=True` (every row one-hot, known to the caller) takes that
    path without drawing any noise.

    Randomness: row b uses n uniforms, then V exponentials (`sample`). A row with a generator draws
    exactly those from it, so its result and its generator's next state depend only on its own
    inputs, never on the batch. Keep `num_draft` on the CPU (the engine decided it): seeded rows
    read their n from it, which on another device would cost a sync. Nothing else syncs.

    Example (k = 2, one row): drafts [5, 9], n = 2, p_0(5) = .6, q_0(5) = .8, u_0 = .5:
    .5 * .8 = .4 < .6, accepted. p_1(9) = .1, q_1(9) = .5, u_1 = .7: .35 >= .1, rejected; the
    recovered token comes from norm(max(0, p_1 - q_1)), say 3.
    -> token_ids [[5, 3, -1]], num_accepted [1].
    """
    _check_shapes(draft_token_ids, num_draft, draft_probs, target_probs, generators)
    batch, k = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)  # [B]
    positions = torch.arange(k, device=device)  # [k]
    num_draft_dev = num_draft.to(device, torch.int64, non_blocking=True)  # [B]
    draft_ids = draft_token_ids.to(device, torch.int64)  # [B, k]
    is_draft = positions.unsqueeze(0) < num_draft_dev.unsqueeze(1)  # [B, k]
    safe_ids = torch.where(is_draft, draft_ids, 0)  # [B, k]; -1 padding is not an index

    # Accept while u * q(d) < p(d); the first rejection ends the row (cumprod of the mask).
    p_draft = target_probs[:, :k].gather(2, safe_ids.unsqueeze(2)).squeeze(2)  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, safe_ids.unsqueeze(2)).squeeze(2)  # [B, k]
    if greedy:  # one-hot p and q: u * q(d) < p(d) iff p(d) = 1, whatever u in [0, 1)
        uniform = torch.zeros(batch, k, device=device)
    else:
        uniform = _draw_uniforms(batch, k, num_draft, generators, device)  # [B, k]
    accept = is_draft & (uniform * q_draft < p_draft)  # [B, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    # One distribution per row: the residual at the first rejection, or p_n for the bonus.
    last = num_accepted  # [B]; the position of the recovered / bonus token
    p_last = target_probs[rows, last].float()  # [B, V]
    rejected = last < num_draft_dev  # [B]
    residual = _residual(p_last, draft_probs, safe_ids, rows, last, k)  # [B, V]
    residual_empty = residual.sum(dim=1) <= 0  # [B]; only from rounding when p ~= q
    use_p = (~rejected | residual_empty).unsqueeze(1)  # [B, 1]
    final_token = sample(torch.where(use_p, p_last, residual), generators, greedy)  # [B]

    token_ids = torch.where(positions.unsqueeze(0) < last.unsqueeze(1), draft_ids, -1)  # [B, k]
    token_ids = torch.cat([token_ids, token_ids.new_full((batch, 1), -1)], dim=1)  # [B, k+1]
    token_ids.scatter_(1, last.unsqueeze(1), final_token.unsqueeze(1))
    return VerifyOutput(token_ids=token_ids, num_accepted=num_accepted)


def _residual(
    p_last: torch.Tensor,  # [B, V]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    safe_ids: torch.Tensor,  # [B, k]
    rows: torch.Tensor,  # [B]
    last: torch.Tensor,  # [B]
    k: int,
) -> torch.Tensor:  # [B, V], unnormalized; meaningful only where the row rejected
    if k == 0:
        return p_last
    at = last.clamp(max=k - 1)  # [B]; rows that took the bonus point anywhere valid
    if draft_probs is None:
        # q one-hot at d: max(0, p - q) is p with d's entry zeroed.
        return p_last.scatter(1, safe_ids[rows, at].unsqueeze(1), 0.0)
    return (p_last - draft_probs[rows, at].float()).clamp_(min=0.0)


def _draw_uniforms(
    batch: int,
    k: int,
    num_draft: torch.Tensor,  # [B]
    generators: list[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:  # [B, k]
    """U[0, 1) per draft; a seeded row draws exactly num_draft[b] values from its generator."""
    uniform = torch.rand(batch, k, device=device)
    seeded = [row for row, generator in enumerate(generators) if generator is not None]
    if seeded and k > 0:
        counts = num_draft.tolist()  # free on the CPU; the only possible sync otherwise
        for row in seeded:
            if counts[row] > 0:
                uniform[row, : counts[row]].uniform_(generator=generators[row])
    return uniform


def _check_shapes(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: list[torch.Generator | None],
) -> None:
    if draft_token_ids.ndim != 2:
        raise ValueError(f"draft_token_ids must be [B, k], got {tuple(draft_token_ids.shape)}")
    batch, k = draft_token_ids.shape
    if target_probs.ndim != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [B, k+1, V] = [{batch}, {k + 1}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[2]
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{batch}, {k}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if num_draft.shape != (batch,):
        raise ValueError(f"num_draft must be [{batch}], got {tuple(num_draft.shape)}")
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for {batch} rows")
    if num_draft.device.type == "cpu" and bool(((num_draft < 0) | (num_draft > k)).any()):
        raise ValueError(f"num_draft must lie in 0..{k}, got {num_draft.tolist()}")
