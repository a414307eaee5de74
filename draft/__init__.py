"""Proposers: a draft model with its own paged cache, or n-gram prompt lookup."""

from specdec.draft.base import DraftOutput, DraftSequence, Proposer, SamplingTensors
from specdec.draft.model_proposer import DraftModelProposer
from specdec.draft.ngram import NgramProposer

__all__ = [
    "DraftModelProposer",
    "DraftOutput",
    "DraftSequence",
    "NgramProposer",
    "Proposer",
    "SamplingTensors",
]
