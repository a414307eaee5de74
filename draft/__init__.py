"""Proposers: a draft model with its own paged cache, n-gram prompt lookup, or both (hybrid)."""

from specdec.draft.base import (
    DraftOutput, DraftSequence, Proposer, SamplingTensors, SeqPlan, StepPlan, StepTimings,
)
from specdec.draft.hybrid import HybridProposer
from specdec.draft.model_proposer import DraftModelProposer
from specdec.draft.ngram import NgramProposer

__all__ = [
    "DraftModelProposer",
    "DraftOutput",
    "DraftSequence",
    "HybridProposer",
    "NgramProposer",
    "Proposer",
    "SamplingTensors",
    "SeqPlan",
    "StepPlan",
    "StepTimings",
]
