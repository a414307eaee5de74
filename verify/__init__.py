"""Logits -> probabilities, rejection sampling and acceptance statistics.

Knows nothing of models or requests: functions take logits/probabilities and per-row tensors.
"""

from specdec.verify.rejection import VerifyOutput, rejection_sample
from specdec.verify.sampling import sample, warp_probs
from specdec.verify.stats import AcceptanceStats, expected_accepted_length

__all__ = [
    "AcceptanceStats",
    "VerifyOutput",
    "expected_accepted_length",
    "rejection_sample",
    "sample",
    "warp_probs",
]
