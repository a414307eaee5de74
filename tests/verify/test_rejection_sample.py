"""rejection_sample: exact greedy tables, padding, seeded determinism, input validation."""

import pytest
import torch

from specdec.verify import VerifyOutput, rejection_sample

V = 10


def _one_hot(argmax_rows: list[list[int]]) -> torch.Tensor:  # [B, k+1, V]
    return torch.nn.functional.one_hot(torch.tensor(argmax_rows), V).float()


def _draft_probs(drafts: torch.Tensor, mode: str) -> torch.Tensor | None:  # [B, k, V]
    if mode == "none":
        return None
    if mode == "one_hot":
        return torch.nn.functional.one_hot(drafts.clamp(min=0), V).float()
    gen = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(*drafts.shape, V, generator=gen), dim=-1)


def _greedy(drafts: list[list[int]], num_draft: list[int], target_argmax: list[list[int]],
            mode: str) -> VerifyOutput:
    draft_ids = torch.tensor(drafts)  # [B, k]
    return rejection_sample(draft_ids, torch.tensor(num_draft), _draft_probs(draft_ids, mode),
                            _one_hot(target_argmax), [None] * len(drafts))


GREEDY_TABLES = [
    # (drafts, num_draft, target argmax per position, expected token_ids, expected num_accepted)
    pytest.param([[1, 2, 3]], [3], [[1, 2, 3, 4]], [[1, 2, 3, 4]], [3], id="all-accepted-bonus"),
    pytest.param([[1, 5, 3]], [3], [[1, 2, 3, 4]], [[1, 2, -1, -1]], [1], id="mismatch-at-1"),
    pytest.param([[7, 2, 3]], [3], [[1, 2, 3, 4]], [[1, -1, -1, -1]], [0], id="mismatch-at-0"),
    pytest.param([[1, 2, 9]], [3], [[1, 2, 3, 4]], [[1, 2, 3, -1]], [2], id="mismatch-last"),
    pytest.param([[-1, -1, -1]], [0], [[6, 2, 3, 4]], [[6, -1, -1, -1]], [0], id="no-drafts"),
    pytest.param(
        [[1, 2, 3], [4, -1, -1], [-1, -1, -1], [5, 6, -1], [5, 8, -1]],
        [3, 1, 0, 2, 2],
        [[1, 2, 3, 0], [4, 7, 9, 9], [8, 9, 9, 9], [5, 6, 2, 9], [5, 6, 2, 9]],
        [[1, 2, 3, 0], [4, 7, -1, -1], [8, -1, -1, -1], [5, 6, 2, -1], [5, 6, -1, -1]],
        [3, 1, 0, 2, 1],
        id="mixed-num-draft-padding",
    ),
]


@pytest.mark.parametrize("mode", ["none", "one_hot", "random_q"])
@pytest.mark.parametrize(("drafts", "num_draft", "target", "expected", "accepted"), GREEDY_TABLES)
def test_greedy_accepts_while_target_argmax_agrees(drafts, num_draft, target, expected, accepted,
                                                   mode) -> None:
    out = _greedy(drafts, num_draft, target, mode)
    assert out.token_ids.tolist() == expected
    assert out.num_accepted.tolist() == accepted
    assert out.token_ids.dtype == out.num_accepted.dtype == torch.int64


def test_greedy_with_zero_width_drafts_is_plain_decoding() -> None:
    out = rejection_sample(torch.empty(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                           None, _one_hot([[3], [7]]), [None, torch.Generator().manual_seed(0)])
    assert out.token_ids.tolist() == [[3], [7]]
    assert out.num_accepted.tolist() == [0, 0]


def _random_step_inputs(gen: torch.Generator, num_draft: list[int], k: int, vocab: int = 16):
    """Flat random p/q (so randomness decides) and drafts sampled from q, padded to width k."""
    batch = len(num_draft)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen), dim=-1)  # [B, k, V]
    target_probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    drafts[torch.arange(k) >= torch.tensor(num_draft).unsqueeze(1)] = -1
    return drafts, torch.tensor(num_draft), draft_probs, target_probs


def _embed(small: tuple, big: tuple, row: int) -> tuple:
    """Copy a single-row step (width k_small) into row `row` of a wider batch."""
    drafts, num_draft, draft_probs, target_probs = (t.clone() for t in big)
    k = small[0].shape[1]
    drafts[row] = -1
    drafts[row, :k] = small[0][0]
    num_draft[row] = small[1][0]
    draft_probs[row, :k] = small[2][0]
    target_probs[row, : k + 1] = small[3][0]
    return drafts, num_draft, draft_probs, target_probs


def test_seeded_row_is_the_same_alone_and_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    steps = [_random_step_inputs(gen, [n], k=n) for n in (2, 3, 0, 2, 1)]  # one row, k = n
    others = [_random_step_inputs(gen, [4, 1, 0, 3], k=4) for _ in steps]

    def run(batch_of, gens: list, row: int) -> list[list[int]]:
        emitted = []
        for step, other in zip(steps, others):
            inputs = batch_of(step, other)
            out = rejection_sample(*inputs, gens)
            emitted.append(out.token_ids[row, : out.num_accepted[row] + 1].tolist())
        return emitted

    alone = run(lambda step, other: step, [torch.Generator().manual_seed(42)], 0)
    seeded = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(42), None]
    mixed = run(lambda step, other: _embed(step, other, 2), seeded, 2)
    unseeded = run(lambda step, other: _embed(step, other, 0),
                   [torch.Generator().manual_seed(42), None, None, None], 0)
    assert alone == mixed == unseeded
    reseeded = run(lambda step, other: step, [torch.Generator().manual_seed(43)], 0)
    assert reseeded != alone  # the seed matters: these steps are genuinely random


def test_deterministic_proposer_seeded_row_is_batch_independent() -> None:
    gen = torch.Generator().manual_seed(5)
    drafts, num_draft, _, target_probs = _random_step_inputs(gen, [3, 2], k=3)
    alone = rejection_sample(drafts[1:], num_draft[1:], None, target_probs[1:],
                             [torch.Generator().manual_seed(9)])
    both = rejection_sample(drafts, num_draft, None, target_probs,
                            [None, torch.Generator().manual_seed(9)])
    assert torch.equal(alone.token_ids[0], both.token_ids[1])


def test_token_the_target_rules_out_is_never_accepted() -> None:
    # p(d) = 0 with q(d) = 1 or q = None: must reject even if u were 0.
    target = torch.full((4096, 2, V), 1.0 / (V - 1))  # [B, k+1, V]
    target[:, 0, 3] = 0.0
    drafts = torch.full((4096, 1), 3)
    out = rejection_sample(drafts, torch.ones(4096, dtype=torch.int64), None, target, [None] * 4096)
    assert out.num_accepted.sum() == 0
    assert (out.token_ids[:, 0] != 3).all() and (out.token_ids[:, 1] == -1).all()


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2,), (2,), None, (2, 2, V)), "draft_token_ids"),
        (((2, 3), (2,), None, (2, 3, V)), "target_probs"),
        (((2, 3), (2,), (2, 3, V + 1), (2, 4, V)), "draft_probs"),
        (((2, 3), (3,), None, (2, 4, V)), "num_draft"),
    ],
)
def test_bad_shapes_raise_value_error(shapes, match: str) -> None:
    drafts, num_draft, draft_probs, target_probs = shapes
    with pytest.raises(ValueError, match=match):
        rejection_sample(torch.zeros(drafts, dtype=torch.int64),
                         torch.zeros(num_draft, dtype=torch.int64),
                         None if draft_probs is None else torch.rand(draft_probs),
                         torch.rand(target_probs), [None, None])


def test_bad_num_draft_or_generators_raise_value_error() -> None:
    drafts, target = torch.zeros(2, 3, dtype=torch.int64), torch.rand(2, 4, V)
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(drafts, torch.tensor([1, 4]), None, target, [None, None])
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(drafts, torch.tensor([1, 2]), None, target, [None])
