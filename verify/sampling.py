"""Logits -> probabilities (the one definition of the sampled distribution) and sampling.

`warp_probs` is used for the draft and the target alike: speculative decoding is lossless only
if `q` and `p` are warped by exactly the same rules. The order is the usual one (HF, vLLM):
temperature, then top-k, then top-p, then renormalize. Both filters keep ties at their boundary,
so the result depends only on the values of a row, not on how a sort orders equal logits.

`sample` uses the exponential race: argmax(w / E) with E ~ Exp(1) i.i.d. picks index i with
probability w_i / sum(w). It needs no normalization, no cumulative sums and no host sync.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny


def warp_probs(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] float
    top_k: torch.Tensor,  # [R] int, <= 0 means off
    top_p: torch.Tensor,  # [R] float, >= 1 means off
) -> torch.Tensor:  # [R, V] float32
    """Turn logits into the sampled distribution of each row.

    Rows with `temperature == 0` are greedy: one-hot at the argmax of the raw logits (first index
    on ties). Other rows: softmax(logits / temperature) restricted to the top-k logits and then to
    the smallest set of most likely tokens whose mass reaches `top_p` (the top token is always
    kept), renormalized.

    Keep `temperature`, `top_k` and `top_p` on the CPU when you can (they are per-request
    settings): then batches where no row filters skip the sort without any device sync. On another
    device the general path runs, which is also sync-free.

    Example: logits = log([1, 2, 3, 4]), temperature 1, top_k 3, top_p 0.5 ->
    top-k keeps [_, .2, .3, .4] / .9; the top token alone has .44 < .5, so the two best stay:
    [0, 0, 3/7, 4/7].
    """
    _check_rows(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    device = logits.device
    greedy = temperature <= 0  # [R]; SamplingParams rejects negative temperatures
    greedy_dev = greedy.to(device, non_blocking=True)
    argmax = logits.argmax(dim=-1, keepdim=True)  # [R, 1]
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=device)
    one_hot.scatter_(1, argmax, 1.0)
    if greedy.device.type == "cpu" and bool(greedy.all()):
        return one_hot

    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / temp.to(device, torch.float32, non_blocking=True).unsqueeze(1)
    use_k, use_p = _filters_needed(greedy, top_k, top_p)
    if use_k or use_p:
        scaled = _apply_top_k_top_p(scaled, top_k.to(device), top_p.to(device), use_p)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    return torch.where(greedy_dev.unsqueeze(1), one_hot, probs)


def sample(
    probs: torch.Tensor,  # [R, V] non-negative weights (need not sum to 1)
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [R] int64
    """Draw one token per row, proportional to `probs`, without leaving the device.

    Rows with a generator take all their noise (V exponentials) from it, so a seeded row gives the
    same token whatever else is in the batch; the others share one batched draw from the default
    RNG. A one-hot row always gives its hot index.
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [R, V], got shape {tuple(probs.shape)}")
    if len(generators) != probs.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {probs.shape[0]} rows")
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)  # [R, V]
    noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # An exact 0 draw would turn 0/0 into NaN, which argmax ranks first.
    noise.clamp_(min=_TINY)
    return (probs.float() / noise).argmax(dim=-1)


def _filters_needed(
    greedy: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[bool, bool]:
    """Whether any sampled row uses top-k / top-p; decided on the host when that is free."""
    if top_k.device.type != "cpu" or top_p.device.type != "cpu" or greedy.device.type != "cpu":
        return True, True  # deciding would need a device sync; the general path is exact
    sampled = ~greedy
    return bool(((top_k > 0) & sampled).any()), bool(((top_p < 1) & sampled).any())


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] float32, temperature applied
    top_k: torch.Tensor,  # [R]
    top_p: torch.Tensor,  # [R]
    use_p: bool,
) -> torch.Tensor:  # [R, V] with filtered logits at -inf
    """Mask every logit below the row's threshold: max(k-th largest, top-p cut-off)."""
    vocab = logits.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)  # [R]; k >= V keeps everything
    k_idx = (top_k.clamp(1, vocab) - 1).long().unsqueeze(1)  # [R, 1]
    neg_inf = torch.full_like(logits[:, :1], float("-inf"))  # [R, 1]
    if not use_p:
        # Top-k alone needs only the largest max_k values, not a full sort.
        if top_k.device.type == "cpu":
            max_k = int(torch.where(k_on, top_k, 1).max())
        else:
            max_k = vocab
        largest = logits.topk(max_k, dim=-1).values  # [R, max_k], descending
        kth = largest.gather(1, k_idx.clamp(max=max_k - 1))  # [R, 1]
        threshold = torch.where(k_on.unsqueeze(1), kth, neg_inf)
        return logits.masked_fill(logits < threshold, float("-inf"))

    sorted_logits = logits.sort(dim=-1, descending=True).values  # [R, V]
    kth = sorted_logits.gather(1, k_idx)  # [R, 1]
    k_threshold = torch.where(k_on.unsqueeze(1), kth, neg_inf)
    sorted_probs = torch.softmax(
        sorted_logits.masked_fill(sorted_logits < k_threshold, float("-inf")), dim=-1
    )  # [R, V]
    # Mass strictly before each token; keep a token while that mass is still < top_p. A cumsum of
    # non-negative numbers is monotone, so the kept tokens form a prefix of the sorted row.
    cumulative = sorted_probs.cumsum(dim=-1)  # [R, V]
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    num_keep = (mass_before < top_p.to(torch.float32).unsqueeze(1)).sum(dim=-1, keepdim=True)
    p_cut = sorted_logits.gather(1, (num_keep.clamp(min=1) - 1))  # [R, 1]
    p_on = (top_p < 1).unsqueeze(1)  # [R, 1]
    p_threshold = torch.where(p_on, p_cut, neg_inf)
    threshold = torch.maximum(k_threshold, p_threshold)  # [R, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _check_rows(logits: torch.Tensor, **per_row: torch.Tensor) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    for name, tensor in per_row.items():
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must be [{rows}], got shape {tuple(tensor.shape)}")
