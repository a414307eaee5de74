"""A draft LM head over a frequent vocabulary (FR-Spec, arXiv 2502.14856; VocabTrim, 2506.22694).

A draft proposes tokens the target then verifies; most of what a chat or code answer says comes
from a small part of a 151,936-token vocabulary, while the draft's LM head reads every row each
token (~27% of the default draft's bytes). `restrict_head` keeps the rows of `num_ids` frequent
ids: the head computes logits for those alone and `expand_logits` puts them back in the full
vocabulary with a fill far below any logit, so the draft's distribution q is zero outside the set
(exp underflows) and the proposals are drawn from exactly the q that is verified: rejection
sampling stays exact, the residual max(0, p - q) covering every id the draft cannot propose.

The order of ids comes from a table counted on the target's own outputs (VocabTrim: that works
best) by `python -m specdec.eval.draft_vocab`, shipped per tokenizer in `vocab/` (keyed by a
fingerprint of the vocabulary); ids it never saw follow in id order (BPE ids grow with merge rank,
roughly with rarity). The special ids and the model's stop ids are always in.

    >>> ids = frequent_ids(tokenizer, 32768, stop_ids=[151645])   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

TABLES = Path(__file__).with_name("vocab")
DEFAULT_SIZE = 32768  # ids a draft head keeps by default where a table matches (docs/results)
FILL = -1.0e4  # logit of an id outside the set: exp(FILL - max) is 0 in fp32 for any real logit
log = logging.getLogger("specdec")


def fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (token -> id): tables apply to the tokenizer they were
    counted with and to no other. Kept on the tokenizer: ~0.4 s for 152k tokens."""
    known = getattr(tokenizer, "_specdec_fingerprint", None)
    if known is None:
        items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        known = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]
        try:
            tokenizer._specdec_fingerprint = known
        except AttributeError:  # a tokenizer that takes no new attributes: hashed each time
            pass
    return known


def table_path(tokenizer) -> Path:
    return TABLES / f"{fingerprint(tokenizer)}.json"


def load_table(tokenizer) -> list[int] | None:
    """The shipped frequency order of ids for this tokenizer, most frequent first; None if none."""
    path = table_path(tokenizer)
    if not path.is_file():
        return None
    return json.loads(path.read_text())["ids"]


def frequent_ids(tokenizer, num_ids: int, stop_ids: list[int], vocab_size: int,
                 table: list[int] | None = None) -> torch.Tensor:
    """The `num_ids` ids a restricted head keeps, ascending `[num_ids]` long: the special and
    stop ids, then the table's order (default: the shipped one), then the rest in id order."""
    if num_ids <= 0 or num_ids > vocab_size:
        raise ValueError(f"a draft vocabulary must keep 1 to {vocab_size} ids, got {num_ids}")
    table = load_table(tokenizer) if table is None else table
    chosen: dict[int, None] = {}
    for i in [*stop_ids, *getattr(tokenizer, "all_special_ids", []), *(table or []), *range(vocab_size)]:
        if 0 <= i < vocab_size:
            chosen.setdefault(int(i), None)
        if len(chosen) >= num_ids:
            break
    return torch.tensor(sorted(chosen), dtype=torch.long)


def restrict_head(model: nn.Module, ids: torch.Tensor) -> None:
    """Give `model` an LM head over `ids [N]` only (`model.head_ids`), its rows taken as they are
    (`qlinear.take_rows`; a dense head: indexed)."""
    from specdec.target.quant.qlinear import QLinear, take_rows

    head = model.lm_head
    if isinstance(head, QLinear):
        model.lm_head = take_rows(head, ids)
    elif type(head) is nn.Linear:
        new = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device=head.weight.device,
                        dtype=head.weight.dtype)
        new.weight = nn.Parameter(head.weight.detach()[ids].clone(), requires_grad=False)
        if head.bias is not None:
            new.bias = nn.Parameter(head.bias.detach()[ids].clone(), requires_grad=False)
        model.lm_head = new
    else:
        raise ValueError(f"a draft vocabulary needs a dense or w4a8 LM head, not {type(head).__name__}")
    model.head_ids = ids.to(head.weight.device if hasattr(head, "weight") else "cpu")


def expand_logits(logits: torch.Tensor, head_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """`logits [A, N]` over `head_ids` -> `[A, vocab_size]`, FILL elsewhere (None: as they are)."""
    if head_ids is None:
        return logits
    full = logits.new_full((logits.shape[0], vocab_size), FILL)
    full[:, head_ids] = logits
    return full
