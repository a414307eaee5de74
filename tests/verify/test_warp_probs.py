"""warp_probs: the one sampled distribution (temperature, top-k, top-p, greedy) and sample()."""

import pytest
import torch

from specdec.verify import sample, warp_probs


def _warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    rows = logits.shape[0]
    return warp_probs(
        logits,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.int64),
        torch.full((rows,), top_p),
    )


def _log(values: list[float]) -> torch.Tensor:  # [1, V]
    return torch.tensor([values]).log()


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        (1.0, [1 / 7, 2 / 7, 4 / 7]),
        (0.5, [1 / 21, 4 / 21, 16 / 21]),  # logits x2 -> weights squared
        (2.0, [1 / (1 + 2**0.5 + 2), 2**0.5 / (1 + 2**0.5 + 2), 2 / (1 + 2**0.5 + 2)]),
    ],
)
def test_temperature_scales_logits(temperature: float, expected: list[float]) -> None:
    probs = _warp(_log([1, 2, 4]), temperature)
    torch.testing.assert_close(probs, torch.tensor([expected], dtype=torch.float32))
    assert probs.dtype == torch.float32


@pytest.mark.parametrize(
    ("values", "top_k", "expected"),
    [
        ([1, 2, 3, 4], 2, [0, 0, 3 / 7, 4 / 7]),
        ([1, 2, 3, 4], 1, [0, 0, 0, 1]),
        ([4, 1, 3, 2], 3, [4 / 9, 0, 3 / 9, 2 / 9]),
        ([1, 2, 2, 4], 2, [0, 2 / 8, 2 / 8, 4 / 8]),  # ties at the k-th value are all kept
        ([1, 2, 3, 4], 0, [0.1, 0.2, 0.3, 0.4]),  # 0 = off
        ([1, 2, 3, 4], 4, [0.1, 0.2, 0.3, 0.4]),  # k >= V = off
        ([1, 2, 3, 4], 99, [0.1, 0.2, 0.3, 0.4]),
    ],
)
def test_top_k_keeps_the_k_largest(values: list[float], top_k: int, expected: list[float]) -> None:
    probs = _warp(_log(values), 1.0, top_k=top_k)
    torch.testing.assert_close(probs, torch.tensor([expected], dtype=torch.float32))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # sorted .4 .3 .2 .1; mass before each: 0 .4 .7 .9; keep while that mass < top_p
        (0.6, [0, 0, 3 / 7, 4 / 7]),
        (0.75, [0, 2 / 9, 3 / 9, 4 / 9]),
        (0.95, [0.1, 0.2, 0.3, 0.4]),
        (0.3, [0, 0, 0, 1]),  # the top token alone already reaches top_p
        (0.0, [0, 0, 0, 1]),  # the top token is always kept
        (1.0, [0.1, 0.2, 0.3, 0.4]),  # 1 = off
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, expected: list[float]) -> None:
    probs = _warp(_log([1, 2, 3, 4]), 1.0, top_p=top_p)
    torch.testing.assert_close(probs, torch.tensor([expected], dtype=torch.float32))


def test_top_k_applies_before_top_p() -> None:
    # top-k 3 renormalizes to [_, .22, .33, .44]: the top token alone (.44) reaches 0.42.
    # Applied to the raw [.1 .2 .3 .4] instead, top-p 0.42 would keep two tokens.
    probs = _warp(_log([1, 2, 3, 4]), 1.0, top_k=3, top_p=0.42)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0, 0, 1]]))
    probs = _warp(_log([1, 2, 3, 4]), 1.0, top_k=3, top_p=0.5)
    torch.testing.assert_close(probs, torch.tensor([[0, 0, 3 / 7, 4 / 7]]))


def test_temperature_applies_before_top_p() -> None:
    # T = 0.5 squares the weights: [1 4 9 16] / 30; top-p 0.6: 16/30 = .53 < .6 -> keep two.
    probs = _warp(_log([1, 2, 3, 4]), 0.5, top_p=0.6)
    torch.testing.assert_close(probs, torch.tensor([[0, 0, 9 / 25, 16 / 25]]))


def test_zero_temperature_is_one_hot_at_argmax_whatever_the_filters() -> None:
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, 5.0, 1.0, 0.0]])  # row 1: tie -> first
    for top_k, top_p in [(0, 1.0), (2, 0.5), (1, 0.0)]:
        probs = _warp(logits, 0.0, top_k=top_k, top_p=top_p)
        torch.testing.assert_close(probs, torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))


def test_rows_in_a_mixed_batch_match_each_row_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen) * 3  # [R, V]
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.9, 1.0, 0.5])
    top_k = torch.tensor([0, 5, 3, 0, 10, 0, 60])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.8, 0.9, 1.0, 0.3])
    batched = warp_probs(logits, temperature, top_k, top_p)  # [R, V]
    for row in range(7):
        alone = warp_probs(logits[row : row + 1], temperature[row : row + 1],
                           top_k[row : row + 1], top_p[row : row + 1])
        torch.testing.assert_close(batched[row : row + 1], alone)
    torch.testing.assert_close(batched.sum(dim=-1), torch.ones(7))
    kept = (batched > 0).sum(dim=-1)  # [R]
    assert kept[1] == 5 and kept[2] == 1 and 1 <= kept[4] <= 10 and kept[0] == 50


def test_low_precision_logits_give_float32_probs() -> None:
    logits = torch.randn(3, 10).to(torch.bfloat16)
    probs = _warp(logits, 0.8, top_k=4)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))


def test_bad_shapes_raise_value_error() -> None:
    with pytest.raises(ValueError, match="logits"):
        warp_probs(torch.zeros(4), torch.ones(1), torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="top_k"):
        warp_probs(torch.zeros(2, 4), torch.ones(2), torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match="generators"):
        sample(torch.ones(2, 4), [None])


def test_sample_one_hot_rows_give_the_hot_index() -> None:
    probs = torch.zeros(64, 1000)  # [R, V]
    hot = torch.randint(0, 1000, (64,))
    probs[torch.arange(64), hot] = 1.0
    for _ in range(5):
        assert torch.equal(sample(probs, [None] * 64), hot)


def test_sample_follows_the_weights_and_needs_no_normalization() -> None:
    torch.manual_seed(0)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]).expand(200_000, 5)  # unnormalized
    counts = torch.bincount(sample(weights, [None] * 200_000), minlength=5) / 200_000
    assert counts[4] == 0
    # Total variation from [.1 .2 .3 .4]; sampling noise at 200k draws is ~0.002.
    assert 0.5 * (counts[:4] - torch.tensor([0.1, 0.2, 0.3, 0.4])).abs().sum() < 0.01


def test_sample_seeded_row_ignores_the_rest_of_the_batch() -> None:
    probs = torch.softmax(torch.randn(4, 300), dim=-1)  # [R, V], flat enough to vary per draw

    def draws(rows: slice, gens: list[torch.Generator | None], index: int) -> list[int]:
        return [sample(probs[rows], gens)[index].item() for _ in range(6)]

    alone = draws(slice(2, 3), [torch.Generator().manual_seed(7)], 0)
    together = draws(slice(0, 4), [None, torch.Generator().manual_seed(1),
                                   torch.Generator().manual_seed(7), None], 2)
    other = draws(slice(1, 4), [None, torch.Generator().manual_seed(7),
                                torch.Generator().manual_seed(3)], 1)
    assert alone == together == other
    assert len(set(alone)) > 1  # the generator advances between calls


def _reference_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Direct float64 transcription of the definition, one row at a time."""
    vocab = logits.numel()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), vocab).double()
    x = logits.double() / temperature
    if 0 < top_k < vocab:
        x[x < x.sort(descending=True).values[top_k - 1]] = float("-inf")
    if top_p < 1:
        probs, order = torch.softmax(x, dim=0).sort(descending=True)
        mass_before = probs.cumsum(0) - probs
        num_keep = max(1, int((mass_before < top_p).sum()))
        x[x < x[order[num_keep - 1]]] = float("-inf")
    return torch.softmax(x, dim=0)


@pytest.mark.parametrize("vocab", [50, 3000])
def test_large_vocab_matches_the_definition_for_narrow_and_wide_nuclei(vocab: int) -> None:
    # Peaked rows have small nuclei (found among the best candidates); flat rows at top-p 0.95
    # need more than 1024 tokens, which forces the full sort on the CPU.
    gen = torch.Generator().manual_seed(vocab)
    scale = torch.tensor([8.0, 8.0, 0.3, 0.3, 2.0, 0.3, 5.0]).unsqueeze(1)
    logits = torch.randn(7, vocab, generator=gen) * scale  # [R, V]
    temperature = torch.tensor([1.0, 0.6, 1.0, 1.2, 0.0, 0.8, 1.0])
    top_k = torch.tensor([0, 20, 0, 0, 5, 2000, 40])
    top_p = torch.tensor([0.9, 0.8, 0.95, 1.0, 0.5, 0.9, 1.0])
    for rows in ([0, 1, 4, 6], list(range(7))):  # without and with a wide nucleus in the batch
        probs = warp_probs(logits[rows], temperature[rows], top_k[rows], top_p[rows])
        for i, row in enumerate(rows):
            expected = _reference_row(logits[row], temperature[row].item(), int(top_k[row]),
                                      top_p[row].item()).float()
            assert torch.equal(probs[i] > 0, expected > 0), f"row {row}: support differs"
            torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=1e-4)
