"""The draft's frequent-vocabulary head (`draft.vocab`): which ids it keeps, its rows taken exactly,
logits back in the full vocabulary, greedy output unchanged, the engine and CLI settings."""

from __future__ import annotations

import argparse

import pytest
import torch

from specdec.draft import vocab
from specdec.target.quant import qgemm
from specdec.testing import from_hf, tiny_hf_model


class _Tokenizer:
    all_special_ids = [9, 2]

    def get_vocab(self):
        return {f"t{i}": i for i in range(40)}


def test_frequent_ids_keep_stops_and_specials_then_the_table_then_id_order():
    ids = vocab.frequent_ids(_Tokenizer(), 8, stop_ids=[31], vocab_size=40, table=[17, 5, 17, 99, 3])
    assert ids.tolist() == sorted([31, 9, 2, 17, 5, 3, 0, 1])
    assert vocab.frequent_ids(_Tokenizer(), 40, [], 40, table=[]).tolist() == list(range(40))
    for bad in (0, 41):
        with pytest.raises(ValueError, match="1 to 40"):
            vocab.frequent_ids(_Tokenizer(), bad, [], 40, table=[])


def test_a_table_applies_only_to_its_own_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(vocab, "TABLES", tmp_path)
    assert vocab.load_table(_Tokenizer()) is None
    vocab.table_path(_Tokenizer()).write_text('{"ids": [7, 3]}')
    assert vocab.load_table(_Tokenizer()) == [7, 3]

    class Other(_Tokenizer):
        def get_vocab(self):
            return {**super().get_vocab(), "extra": 40}

    assert vocab.load_table(Other()) is None


def test_expanded_logits_give_zero_probability_outside_the_set():
    logits = torch.tensor([[2.0, -30.0, 5.0]])
    full = vocab.expand_logits(logits, torch.tensor([1, 4, 6]), 8)
    probs = torch.softmax(full, -1)
    assert torch.equal(full[:, [1, 4, 6]], logits)
    assert (probs[:, [0, 2, 3, 5, 7]] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(1))
    assert vocab.expand_logits(logits, None, 8) is logits


@pytest.mark.skipif(qgemm.unavailable_reason() is not None, reason="w4a8 kernel unavailable")
@pytest.mark.parametrize("kind", ["int4", "int8", "Q8_0"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_a_quantized_heads_rows_are_taken_exactly(kind, shuffled):
    from specdec.kernel_abi import TILE_Q8_0
    from specdec.target.quant.qgemm import tile_size
    from specdec.target.quant.qlinear import QLinear, dequantize, take_rows
    from tests.target.test_kquant import k_blocks
    from tests.target.test_quant import grid_weights

    if kind == "Q8_0":  # a GGUF's tied Q8_0 embedding as the head, read as stored
        head = QLinear.from_gguf(k_blocks(TILE_Q8_0, 64, 96, seed=1), TILE_Q8_0, 96, torch.randn(64))
    else:
        w = grid_weights(64, 96, seed=1) if kind == "int4" else torch.randn(64, 96) * 0.05
        head = QLinear.from_weight(w, torch.randn(64), int4_max_error=0.02)
    if shuffled:  # the same tiles stored in another order, found through tile_offsets
        size = tile_size(int(head.tile_bits[0]), 96)
        order = torch.tensor([2, 0, 3, 1])
        head.tiles = head.tiles.view(4, size)[order].reshape(-1).clone()
        head.tile_offsets = order.argsort() * size
    ids = torch.tensor(sorted(torch.randperm(64, generator=torch.Generator().manual_seed(2))[:32].tolist()))
    rows = take_rows(head, ids)
    assert torch.equal(rows.tile_bits.unique(), head.tile_bits.unique())
    assert torch.equal(dequantize(rows), dequantize(head)[ids]) and torch.equal(rows.bias, head.bias[ids])
    x = torch.randn(3, 96).bfloat16()
    assert torch.equal(rows(x), head(x)[:, ids])
    with pytest.raises(ValueError, match="whole tiles"):
        take_rows(head, ids[:5])


def test_greedy_speculation_with_a_cut_head_equals_target_only():
    from tests.engine.conftest import make_engine

    target = from_hf(tiny_hf_model("llama", seed=1, vocab_size=64))
    draft = from_hf(tiny_hf_model("llama", seed=1, vocab_size=64))  # the target's twin: drafts accepted
    vocab.restrict_head(draft, torch.arange(0, 64, 2))
    from specdec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 5, 7, 9], [11, 2, 4]]
    spec = make_engine(target, draft, num_speculative_tokens=3).generate(prompts, params)
    plain = make_engine(target).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_draft_vocab_setting_is_checked():
    from specdec import EngineConfig
    from specdec.api.args import _draft_vocab

    assert _draft_vocab("32768") == 32768 and _draft_vocab("full") == "full"
    with pytest.raises(argparse.ArgumentTypeError):
        _draft_vocab("-3")
    with pytest.raises(ValueError, match="draft_vocab"):
        EngineConfig(draft_vocab=0)
