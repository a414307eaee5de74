"""Prompt lookup first, the draft model where it finds nothing.

A prompt-lookup proposal costs no forward pass, and code often repeats itself (names, signatures,
docstring examples); the draft model costs ~40% of a target forward per token on the default pair
on a CPU. So for each sequence this proposer first looks for the longest recent n-gram (n >=
`min_n`) that occurred earlier; when one did, it proposes what followed it, and only the other
sequences run the draft model. Rows of either kind verify together: a prompt-lookup row's q is
one-hot at its tokens, which rejection sampling handles like any other q, so the output
distribution stays the target's.

The draft model's cache falls behind on steps that used prompt lookup; its next step catches up
(a few rows in one forward).

`min_n=2`: on greedy target outputs for 10 HumanEval / 10 ShareGPT prompts (128 tokens), the
bigrams that no 3-gram covers still yield 2.9 / 2.6 tokens per lookup step (48% miss at the first
token), where a draft-model step yields ~3.4 / ~2.8 tokens for ~2x the time; at fixed k = 4 the
engine needed 838 instead of 969 draft forwards on HumanEval and 1178 instead of 1247 on ShareGPT
(+4.7% / +1.2% modeled tokens/s).
"""

from __future__ import annotations

import torch

from specdec.cache import BlockPool
from specdec.draft.base import DraftOutput, SamplingTensors, StepPlan
from specdec.draft.model_proposer import DraftModelProposer, tree_gains
from specdec.draft.ngram import NgramProposer


class HybridProposer:
    """`NgramProposer(min_n, max_n)` where it matches, `DraftModelProposer` elsewhere."""

    def __init__(self, model: DraftModelProposer, min_n: int = 2, max_n: int = 4) -> None:
        self.model = model
        self.ngram = NgramProposer(min_n, max_n, model.runner.device)

    @property
    def pool(self) -> BlockPool:
        return self.model.pool

    @property
    def runner(self):
        return self.model.runner

    @property
    def forward_seconds(self) -> list[tuple[int, float]]:
        return self.model.forward_seconds

    def draft_slots_needed(self, num_tokens: int, num_draft: int) -> int:
        return self.model.draft_slots_needed(num_tokens, num_draft)

    def keep_tree_path(self, row: int, seq, path: list[int]) -> None:
        self.model.keep_tree_path(row, seq, path)

    def propose(self, plan: StepPlan, sampling: SamplingTensors) -> DraftOutput:
        """Per row: what prompt lookup finds (up to `num_lookup`, even where `num_draft` is 0),
        else the draft model's proposal (up to `num_draft`); the plan's fills ride in the model's
        first forward."""
        looked_up = [self.ngram.lookup(p.seq.token_ids, p.num_lookup) for p in plan.rows]
        model_k = [0 if found else p.num_draft for found, p in zip(looked_up, plan.rows)]
        caps = [0 if found else p.cap for found, p in zip(looked_up, plan.rows)]  # grammar-forced drafts
        seqs = [p.seq for p in plan.rows]
        self.model.queue_fills(plan)
        if self.model.tree:  # the model's rows are trees, the looked-up ones chains (probs None)
            self.model.trees = []
            nodes = [p.tree_rows for p in plan.rows]
            gains = tree_gains(plan.rows)
            out = self.model.draft_tree(seqs, model_k, nodes, sampling, gains) if any(model_k) else None
        else:
            forcing = self.model.grammar_forced and sampling.controls is not None and any(caps)
            out = self.model.draft(seqs, model_k, sampling, caps) if any(model_k) or forcing else None
        self.model.flush()
        drafted = out.num_draft if out is not None else [0] * len(seqs)  # may stop short of model_k
        counts = [len(found) if found else n for found, n in zip(looked_up, drafted)]
        k = max(counts, default=0)
        device = self.model.runner.device
        token_ids = torch.full((len(seqs), k), -1, dtype=torch.long, device=device)  # [B, k]
        if out is not None:
            token_ids[:, : out.token_ids.shape[1]] = out.token_ids[:, :k]
        for b, found in enumerate(looked_up):
            if found:
                token_ids[b, : len(found)] = torch.tensor(found, dtype=torch.long, device=device)
        from_lookup = [bool(found) for found in looked_up]
        if out is None or out.probs is None:
            parents = out.parents if out is not None else None
            return DraftOutput(token_ids, None, counts, from_lookup, parents)
        probs = torch.zeros(len(seqs), k, out.probs.shape[-1], device=device)  # [B, k, V]
        probs[:, : out.probs.shape[1]] = out.probs[:, :k]
        for b, found in enumerate(looked_up):
            if found:  # q one-hot at the looked-up tokens
                probs[b, : len(found)] = 0
                probs[b, torch.arange(len(found), device=device), torch.tensor(found, device=device)] = 1.0
        return DraftOutput(token_ids, probs, counts, from_lookup)
