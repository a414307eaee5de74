"""The verify half of a step: ONE target forward over every row's window, then rejection sampling.

A row's window is [tokens the target's cache lacks (the last one, or the rest of the prompt)] +
[d_1..d_n]; its last n + 1 rows of logits verify the drafts. Prefill chunks that stop short of
their prompt ride in the same forward without logits.

Example: a sequence [a b c] whose cache holds [a b], drafts [x y] -> window [c x y], 3 rows of
logits: p(.|..c) checks x, p(.|..x) checks y, p(.|..y) is the bonus row.
"""

from __future__ import annotations

import itertools

import torch

from specdec.draft import DraftOutput, SamplingTensors, StepPlan, StepTimings
from specdec.expert_stats import ExpertStats
from specdec.sequence import Sequence, TokenLogprobs
from specdec.target.runner import ModelRunner, Window
from specdec.verify import VerifyOutput, rejection_sample
from specdec.verify.tree import tree_accept


class Verifier:
    """Runs the target over a step's windows (timed into `timings` while enabled) and accepts."""

    def __init__(self, target: ModelRunner, timings: StepTimings) -> None:
        self.target, self.timings = target, timings
        self.num_decode_rows = 0  # rows of decoding sequences' windows in the latest forward
        routing = target.routing  # an MoE target: the experts its verify windows read
        self.expert_stats = None if routing is None else ExpertStats(*routing)

    def forward(self, plan: StepPlan, draft: DraftOutput) -> torch.Tensor:
        """Logits `[sum(n_b + 1), V]` of every row's window; the fills' full blocks go to the
        prefix caches."""
        windows = [self._window(p.seq, draft.token_ids[b, : draft.num_draft[b]], draft.tree(b))
                   for b, p in enumerate(plan.rows)]
        self.num_decode_rows = sum(len(w.token_ids) for w, p in zip(windows, plan.rows) if p.seq.num_pending <= 1)
        fills = [p.seq for p in plan.seqs if p.seq.fills_only and p.seq.num_new_tokens]
        windows += [_fill_window(s) for s in fills]
        if not windows:  # only draft fills this step (requests handing their KV over)
            return torch.empty(0, self.target.output_vocab, device=self.target.device)
        owners = [p.seq for p in plan.rows] + fills
        leads = [_prompt_rows(w, seq, i >= len(plan.rows)) for i, (w, seq) in enumerate(zip(windows, owners))]
        starts = [w.table.num_computed for w in windows]
        records = self.timings.verify if plan.rows else []  # a prefill-only step prices no verify
        with self.timings.timing(records, sum(len(w.token_ids) for w in windows), self.target.device):
            logits = self.target.forward(windows)
        _cache_full_blocks(fills)
        if self.expert_stats is not None:
            self._count_experts(plan, windows)
        if any(leads):
            logits = _take_prompt_logprobs(logits, windows, owners, leads, starts)
        return logits

    def _count_experts(self, plan: StepPlan, windows: list[Window]) -> None:
        """Record the experts the decoding windows (not prefill chunks) read this forward."""
        spans, at = [], 0
        for i, w in enumerate(windows):
            if i < len(plan.rows) and plan.rows[i].seq.num_pending <= 1:
                spans.append((at, at + len(w.token_ids)))
            at += len(w.token_ids)
        if spans:
            self.timings.verify_experts = self.expert_stats.record(self.target.expert_ids(), spans)

    @staticmethod
    def accept(
        logits: torch.Tensor, draft: DraftOutput, sampling: SamplingTensors
    ) -> tuple[VerifyOutput, torch.Tensor]:
        """Rejection sampling of each row's drafts against the target's warped probabilities.
        Also returns the logits with each row's logit controls applied along its own prefix
        (row j of sequence b after its drafts d_1..d_j), which `logprobs` reads."""
        counts = [n + 1 for n in draft.num_draft]
        if sampling.controls is not None:
            drafts = draft.token_ids.tolist()  # [B, k] on the host (penalties count the drafts)
            owners = [b for b, c in enumerate(counts) for _ in range(c)]
            extra = [_before(drafts[b], draft.tree(b), j) for b, c in enumerate(counts) for j in range(c)]
            logits = sampling.controlled(logits, owners, extra)
        if draft.parents is not None and any(t is not None for t in draft.parents):
            return _accept_trees(draft, sampling.repeat(counts).warp(logits), counts, sampling), logits
        target_probs = _pad_rows(sampling.repeat(counts).warp(logits), counts)  # [B, k+1, V]
        out = rejection_sample(
            draft.token_ids, torch.tensor(draft.num_draft), draft.probs, target_probs,  # [B, k], [B, k+1, V]
            sampling.generators, greedy=sampling.all_greedy,
        )
        return out, logits

    @staticmethod
    def logprobs(
        logits: torch.Tensor,  # [sum(n_b + 1), V] controlled logits of the step's rows
        counts: list[int],  # [B] rows per sequence (n_b + 1)
        emitted: list[list[int]],  # [B] the tokens each sequence emitted, from its first row on
        temperature: list[float],  # [B]
        num_top: list[int | None],  # [B] alternatives wanted; None: no logprobs for this sequence
        paths: list[list[int] | None] | None = None,  # [B] a tree row's accepted rows (VerifyOutput.paths)
    ) -> list[list[TokenLogprobs] | None]:
        """Each emitted token's log-probability under the target's distribution at its row (after
        the logit controls and the temperature, 1 for greedy rows; before min-p/top-k/top-p) and the
        `num_top[b]` most likely alternatives. Accepted, recovered and bonus tokens alike: row j's
        distribution is what the token at position j was verified or sampled against (a tree's:
        row 0, then the rows of its accepted path)."""
        starts = [0, *itertools.accumulate(counts)]  # first row of each sequence
        wanted = [b for b, n in enumerate(num_top) if n is not None and emitted[b]]
        result: list[list[TokenLogprobs] | None] = [None] * len(counts)
        if not wanted:
            return result
        rows = [starts[b] + r for b in wanted for r in _path_rows(paths, b, len(emitted[b]))]
        temps = [temperature[b] if temperature[b] > 0 else 1.0 for b in wanted for _ in emitted[b]]
        index = torch.tensor(rows, device=logits.device)
        scaled = logits.index_select(0, index).float() / torch.tensor(temps, device=logits.device).unsqueeze(1)
        logp = torch.log_softmax(scaled, dim=-1)  # [M, V]
        tokens = torch.tensor([t for b in wanted for t in emitted[b]], device=logits.device)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()  # [M]
        width = max(num_top[b] for b in wanted)
        top_values, top_ids = logp.topk(width, dim=-1) if width else (logp[:, :0], logp[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        m = 0
        for b in wanted:
            entries = []
            for token in emitted[b]:
                n = num_top[b]
                entries.append(TokenLogprobs(token, chosen[m], list(zip(top_ids[m][:n], top_values[m][:n]))))
                m += 1
            result[b] = entries
        return result

    def _window(self, seq: Sequence, drafts: torch.Tensor, tree: list[int] | None) -> Window:
        table = seq.target_table
        pending = seq.token_ids[table.num_computed :]
        if drafts.numel() == 0:
            return Window(table, pending, 1)
        if tree is not None and len(pending) != 1:
            raise ValueError(f"a token tree roots at the sequence's last token; its window has {len(pending)} pending")
        head = torch.tensor(pending, dtype=torch.long, device=self.target.device)
        return Window(table, torch.cat([head, drafts]), drafts.numel() + 1, parents=tree)


def _prompt_rows(window: Window, seq: Sequence, fill: bool) -> int:
    """Leading rows of `window` whose logits score the prompt's next tokens (`prompt_logprobs`),
    its `num_logits` widened to cover them; 0 where the sequence wants none or has them all.
    A fill's rows all score prompt tokens; a row window's rows before its verify rows do."""
    if seq.params.prompt_logprobs is None or len(seq.prompt_logprobs or []) >= seq.prompt_len - 1:
        return 0
    lead = len(window.token_ids) if fill else len(window.token_ids) - window.num_logits
    window.num_logits += lead
    return lead


def _take_prompt_logprobs(logits: torch.Tensor, windows: list[Window], owners: list[Sequence], leads: list[int],
                          starts: list[int]) -> torch.Tensor:
    """Record the prompt logprobs of the windows' leading rows (row at position p scores prompt
    token p + 1: a plain log-softmax, the token's and the `prompt_logprobs` most likely); returns
    the other rows, the step's verify logits."""
    keep, at = [], 0
    for w, seq, lead, start in zip(windows, owners, leads, starts):
        keep += range(at + lead, at + w.num_logits)
        first = len(seq.prompt_logprobs or []) - start  # the row scoring the next unscored token
        last = min(lead, seq.prompt_len - 1 - start)  # rows past the prompt (a recompute's) score nothing
        if lead and 0 <= first < last:
            seq.prompt_logprobs = (seq.prompt_logprobs or []) + _logprobs_of(
                logits[at + first : at + last], seq.token_ids[start + first + 1 : start + last + 1],
                seq.params.prompt_logprobs)
        at += w.num_logits
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]


def _logprobs_of(logits: torch.Tensor, tokens: list[int], top: int, rows_at_once: int = 64) -> list[TokenLogprobs]:
    """Each row's log-softmax at its token and its `top` most likely (fp32, `rows_at_once` rows
    of the vocabulary at a time)."""
    out = []
    for i in range(0, len(tokens), rows_at_once):
        logp = torch.log_softmax(logits[i : i + rows_at_once].float(), dim=-1)
        ids = torch.tensor(tokens[i : i + rows_at_once], device=logp.device)
        picked = logp.gather(1, ids.unsqueeze(1))  # [n, 1]
        ranks = ((logp > picked).sum(dim=-1) + 1).tolist()
        values, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        for token, value, rank, tv, ti in zip(tokens[i : i + rows_at_once], picked.squeeze(1).tolist(), ranks,
                                              values.tolist(), top_ids.tolist()):
            out.append(TokenLogprobs(token, value, list(zip(ti, tv)), rank))
    return out


def _fill_window(seq: Sequence) -> Window:
    """The next prefill chunk of a sequence whose prompt it does not finish (no logits)."""
    start = seq.target_table.num_computed
    return Window(seq.target_table, seq.token_ids[start : start + seq.num_new_tokens], 0)


def _cache_full_blocks(seqs: list[Sequence]) -> None:
    """Offer both pools' prefix caches the blocks these sequences have written in full."""
    for seq in seqs:
        for table in (seq.target_table, seq.draft_table):
            if table is not None:
                table.cache_full_blocks(seq.token_ids)


def _before(drafts: list[int], tree: list[int] | None, row: int) -> list[int]:
    """The drafts ahead of window row `row` on its path (a chain's: the first `row`)."""
    if tree is None:
        return drafts[:row]
    path = []
    while row > 0:
        path.append(drafts[row - 1])
        row = tree[row]
    return path[::-1]


def _path_rows(paths: list[list[int] | None] | None, b: int, n: int) -> list[int]:
    """The window rows of sequence b's first n emitted tokens (row 0, then its accepted rows)."""
    path = paths[b] if paths is not None else None
    return list(range(n)) if path is None else [0, *path][:n]


def _accept_trees(draft: DraftOutput, probs: torch.Tensor, counts: list[int], sampling: SamplingTensors) -> VerifyOutput:
    """`tree_accept` per row (`probs [sum(counts), V]`, the rows' warped distributions); a chain
    row is the tree whose nodes are each under the one before."""
    if draft.probs is not None:
        raise ValueError("a token tree's drafts are deterministic proposals: probs must be None")
    starts = [0, *itertools.accumulate(counts)]
    greedy = sampling.all_greedy
    drafts = draft.token_ids.tolist()
    results = []
    for b, n in enumerate(draft.num_draft):
        tree = draft.tree(b) or [-1, *range(n)]
        results.append(tree_accept(tree, [-1, *drafts[b][:n]], probs[starts[b] : starts[b + 1]],
                                   sampling.generators[b], greedy))
    width = max(counts)
    token_ids = torch.full((len(counts), width), -1, dtype=torch.long)
    for b, r in enumerate(results):
        token_ids[b, : len(r.token_ids)] = torch.tensor(r.token_ids)
    paths = [r.path if draft.tree(b) is not None else None for b, r in enumerate(results)]
    return VerifyOutput(token_ids, torch.tensor([r.num_accepted for r in results]), paths)


def _pad_rows(flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`flat [sum(counts), V]` -> `[B, max(counts), V]`, zero rows where a sequence has fewer."""
    b, width = len(counts), max(counts)
    if all(c == width for c in counts):
        return flat.view(b, width, -1)
    out = flat.new_zeros(b, width, flat.shape[-1])
    bi = [i for i, c in enumerate(counts) for _ in range(c)]
    ji = [j for c in counts for j in range(c)]
    out[bi, ji] = flat
    return out
