"""Logits -> probabilities (the one definition of the sampled distribution) and sampling.

`warp_probs` is used for the draft and the target alike: speculative decoding is lossless only
if `q` and `p` are warped by exactly the same rules. The order is vLLM's: temperature, then min-p,
then top-k, then top-p, then renormalize (the logit controls come before, `verify.controls`). Both filters keep ties at their boundary,
so the result depends only on the values in a row, never on how a sort orders equal logits.

`sample` uses the exponential race: argmax(w / E) with E ~ Exp(1) i.i.d. picks index i with
probability w_i / sum(w). It needs no normalization, no cumulative sums and no host sync.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny
# On the CPU a full sort of a 150k vocabulary costs ~20 ms per row; top-p first looks for its
# cut-off among this many best tokens (topk: ~1 and ~4 ms per row) and sorts everything only when
# the nucleus is wider still.
_TOP_P_CANDIDATES = (1024, 16384)


def warp_probs(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] float
    top_k: torch.Tensor,  # [R] int, <= 0 means off
    top_p: torch.Tensor,  # [R] float, >= 1 means off
    min_p: torch.Tensor | None = None,  # [R] float, 0 means off
) -> torch.Tensor:  # [R, V] float32
    """Turn logits into the sampled distribution of each row.

    Rows with `temperature == 0` are greedy: one-hot at the argmax of the logits (first index
    on ties). Other rows: softmax(logits / temperature) without the tokens whose probability is
    below `min_p` times the top token's, restricted to the top-k logits and then to the smallest
    set of most likely tokens whose mass reaches `top_p` (the top token is always kept),
    renormalized.

    Keep `temperature`, `top_k` and `top_p` on the CPU when you can (they are per-request
    settings): batches where no row filters, or no row is greedy, then skip that work without any
    device sync. On another device the general path runs, which is sync-free too.

    Example: logits = log([1, 2, 3, 4]), temperature 1, top_k 3, top_p 0.5 ->
    top-k keeps [_, .2, .3, .4] / .9; the top token alone has .44 < .5, so the two best stay:
    [0, 0, 3/7, 4/7].
    """
    _check_rows(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if min_p is not None:
        _check_rows(logits, min_p=min_p)
    greedy = temperature <= 0  # [R]; SamplingParams rejects negative temperatures
    on_host = all(t.device.type == "cpu" for t in (temperature, top_k, top_p))
    any_greedy = bool(greedy.any()) if on_host else True
    if on_host and bool(greedy.all()):
        return _one_hot_argmax(logits)

    temp = torch.where(greedy, torch.ones_like(temperature), temperature)  # [R]
    scaled = logits.float() / temp.to(logits.device, torch.float32).unsqueeze(1)  # [R, V]
    sampled = ~greedy
    if min_p is not None and (not on_host or bool(((min_p > 0) & sampled).any())):
        # p_i < min_p * p_max  <=>  scaled_i < scaled_max + log(min_p); log(0) = -inf masks nothing.
        floor = scaled.amax(dim=-1, keepdim=True) + min_p.to(logits.device, torch.float32).log().unsqueeze(1)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    use_k = bool(((top_k > 0) & sampled).any()) if on_host else True
    use_p = bool(((top_p < 1) & sampled).any()) if on_host else True
    if use_k or use_p:
        scaled = _apply_top_k_top_p(scaled, top_k.to(logits.device), top_p.to(logits.device), use_p)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    if not any_greedy:
        return probs
    return torch.where(greedy.to(logits.device).unsqueeze(1), _one_hot_argmax(logits), probs)


def sample(
    probs: torch.Tensor,  # [R, V] non-negative weights (need not sum to 1)
    generators: list[torch.Generator | None],
    greedy: bool = False,
) -> torch.Tensor:  # [R] int64
    """Draw one token per row, proportional to `probs`, without leaving the device.

    `greedy=True` says every row is one-hot (temperature 0 everywhere): the hot index is taken
    directly, with no noise drawn (seeded generators are not advanced).

    Rows with a generator take all their noise (V uniforms) from it, so a seeded row gives the
    same token whatever else is in the batch; the others share one batched draw from the default
    RNG. A one-hot row always gives its hot index; a zero weight is never drawn.
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [R, V], got shape {tuple(probs.shape)}")
    if len(generators) != probs.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {probs.shape[0]} rows")
    if greedy:
        return probs.argmax(dim=-1)
    uniform = torch.empty(probs.shape, device=probs.device)  # [R, V] in [0, 1)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if len(unseeded) == len(generators):
        uniform.uniform_()
    else:
        for row, generator in enumerate(generators):
            if generator is not None:
                uniform[row].uniform_(generator=generator)
        if unseeded:  # one batched draw for the rest (each row's V uniforms cost ~0.4 ms on a CPU)
            rows = torch.tensor(unseeded, device=probs.device)
            uniform.index_copy_(0, rows, torch.rand(len(unseeded), probs.shape[1], device=probs.device))
    # log U = -E with E ~ Exp(1), so argmax(w / E) = argmin(w / log U). Clamping U away from 0
    # keeps every E finite: an infinite E would tie a real token with the zero weights.
    log_uniform = uniform.clamp_(min=_TINY).log_()  # [R, V], all < 0
    return (probs.float() / log_uniform).argmin(dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [R, V] float32
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] float32, temperature applied
    top_k: torch.Tensor,  # [R]
    top_p: torch.Tensor,  # [R]
    use_p: bool,
) -> torch.Tensor:  # [R, V] with filtered logits at -inf
    """Mask every logit below its row's threshold: max(k-th largest, top-p cut-off)."""
    vocab = logits.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)  # [R]; k >= V keeps everything
    widths = [vocab]  # how many of the best logits to look at, in descending order
    if logits.device.type == "cpu":  # host values are free here; elsewhere sort everything
        max_k = int(torch.where(k_on, top_k, 1).max())
        if not use_p:
            widths = [max_k]
        else:
            widths = sorted({min(vocab, max(max_k, w)) for w in _TOP_P_CANDIDATES} | {vocab})
    for width in widths:
        threshold = _threshold(logits, top_k, top_p, k_on, width, use_p)
        if threshold is not None:  # None: some nucleus is wider than `width`; look further
            break
    return logits.masked_fill(logits < threshold, float("-inf"))


def _threshold(
    logits: torch.Tensor,  # [R, V]
    top_k: torch.Tensor,  # [R]
    top_p: torch.Tensor,  # [R]
    k_on: torch.Tensor,  # [R] bool
    width: int,
    use_p: bool,
) -> torch.Tensor | None:  # [R, 1]; None when width < V does not reach a top-p cut-off
    vocab = logits.shape[-1]
    if width < vocab:
        head = logits.topk(width, dim=-1).values  # [R, width], descending
    else:
        head = logits.sort(dim=-1, descending=True).values  # [R, V]
    neg_inf = torch.full_like(head[:, :1], float("-inf"))  # [R, 1]
    kth = head.gather(1, (top_k.clamp(1, width) - 1).long().unsqueeze(1))  # [R, 1]
    k_threshold = torch.where(k_on.unsqueeze(1), kth, neg_inf)
    if not use_p:
        return k_threshold

    # Probabilities after top-k; the normalizer spans the whole row, so a head and a full sort
    # give the same numbers.
    log_norm = torch.logsumexp(logits.masked_fill(logits < k_threshold, float("-inf")), dim=-1)
    head_probs = (head - log_norm.unsqueeze(1)).exp().masked_fill(head < k_threshold, 0.0)
    # Mass strictly before each token; keep a token while that mass is still < top_p. A cumsum of
    # non-negative numbers is monotone, so the kept tokens form a prefix of the sorted row.
    cumulative = head_probs.cumsum(dim=-1)  # [R, width]
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    num_keep = (mass_before < top_p.float().unsqueeze(1)).sum(dim=-1, keepdim=True)  # [R, 1]
    p_on = (top_p < 1).unsqueeze(1)  # [R, 1]
    if width < vocab and bool((p_on & (num_keep == width)).any()):
        return None
    p_cut = head.gather(1, num_keep.clamp(min=1) - 1)  # [R, 1]
    return torch.maximum(k_threshold, torch.where(p_on, p_cut, neg_inf))


def _check_rows(logits: torch.Tensor, **per_row: torch.Tensor) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    for name, tensor in per_row.items():
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must be [{rows}], got shape {tuple(tensor.shape)}")
