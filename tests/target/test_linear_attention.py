"""Hybrid models (issue 61): Qwen3-Next's Gated DeltaNet layers beside full attention give
transformers' logits through our runner, prompt fed whole or in chunks, several sequences in one
forward; a verify window's rejected rows are dropped by starting from the state of the last kept
row (`cache.state_cache`), so decoding after a rollback is transformers' on the kept tokens."""

import pytest
import torch

from specdec.cache import RecurrentStateCache, StateSpec
from specdec.target.config import ModelConfig
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.hybrid_models import FAMILIES, hybrid_hf_model

PROMPT = [5, 17, 33, 8, 61, 9, 42, 11, 70, 3, 25]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def _runner(hf, depth: int = 6, block_size: int = 4) -> ModelRunner:
    return ModelRunner.build(from_hf(hf), block_size=block_size, num_blocks=64, state_slots=4, state_depth=depth)


def _feed(runner, table, ids, num_logits=None):
    table.ensure_slots(table.num_computed + len(ids))
    return runner.forward([Window(table, ids, len(ids) if num_logits is None else num_logits)])


def test_config_reads_the_hybrid_layers():
    cfg = ModelConfig.from_hf(hybrid_hf_model("moe").config)
    assert cfg.linear.layers == (0, 1, 2) and cfg.is_linear_layer(2) and not cfg.is_linear_layer(3)
    assert cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 8
    assert cfg.offset_norms and cfg.attn_output_gate and cfg.qk_norm and cfg.rotary_dim == 4
    assert cfg.moe.num_experts == 4 and cfg.moe.shared_expert_size == 32
    assert ModelConfig.from_hf(hybrid_hf_model("dense").config).moe is None
    q35 = ModelConfig.from_hf(hybrid_hf_model("qwen3.5-moe").config)
    assert q35.linear.split_projections and not cfg.linear.split_projections
    assert q35.moe.norm_topk and q35.moe.shared_expert_size == 32 and q35.rotary_dim == 4
    assert "linear attention" in cfg.c_loop_differences() and cfg.unquantized_reason() is not None


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_prefill_whole_and_in_chunks_matches_transformers(kind):
    hf = hybrid_hf_model(kind)
    ref = _hf_logits(hf, PROMPT)
    runner = _runner(hf)
    table = runner.new_table()
    whole = _feed(runner, table, PROMPT)
    assert (whole - ref).abs().max().item() < 1e-4
    table.free()
    chunks, at = [], 0
    for n in (4, 1, 3, 2, 1):  # chunked prefill, then one-token decode steps
        chunks.append(_feed(runner, table, PROMPT[at:at + n]))
        at += n
    assert (torch.cat(chunks) - ref).abs().max().item() < 1e-4
    table.free()
    assert runner.states.pool.num_free == 4 and runner.pool.num_free == runner.pool.num_blocks


def test_sequences_in_one_forward_keep_their_own_states():
    hf = hybrid_hf_model("dense")
    runner = _runner(hf)
    a, b = runner.new_table(), runner.new_table()
    other = [9, 8, 7, 6, 5, 4, 3]
    a.ensure_slots(len(PROMPT)), b.ensure_slots(len(other))
    runner.forward([Window(a, PROMPT[:6], 0), Window(b, other[:2], 0)])
    logits = runner.forward([Window(a, PROMPT[6:], 1), Window(b, other[2:], 1)])
    assert (logits[0] - _hf_logits(hf, PROMPT)[-1]).abs().max().item() < 1e-4
    assert (logits[1] - _hf_logits(hf, other)[-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["moe", "qwen3.5"])
@pytest.mark.parametrize("kept", [0, 1, 3, 4])
def test_a_rolled_back_verify_window_decodes_on_from_the_kept_rows(kept, kind):
    """A 5-row verify window (the last token + 4 drafts), `kept` drafts accepted: truncating the
    table is all the rollback; the next token's logits are transformers' on the kept tokens."""
    hf = hybrid_hf_model(kind)
    runner = _runner(hf)
    table = runner.new_table()
    _feed(runner, table, PROMPT[:-1], 0)
    drafts = [40, 41, 42, 43]
    window = _feed(runner, table, [PROMPT[-1], *drafts])
    assert (window - _hf_logits(hf, PROMPT + drafts)[-5:]).abs().max().item() < 1e-4
    table.truncate(len(PROMPT) + kept)
    nxt = _feed(runner, table, [77])
    ref = _hf_logits(hf, PROMPT + drafts[:kept] + [77])[-1]
    assert (nxt[0] - ref).abs().max().item() < 1e-4


def test_a_rollback_past_the_kept_states_fails_clearly():
    hf = hybrid_hf_model("dense")
    runner = _runner(hf, depth=3)
    table = runner.new_table()
    _feed(runner, table, PROMPT)  # states kept after lengths 9, 10, 11
    table.truncate(7)
    with pytest.raises(RuntimeError, match="as of 7 tokens is not kept"):
        _feed(runner, table, [1])


def test_trees_are_refused_over_linear_attention():
    runner = _runner(hybrid_hf_model("dense"))
    table = runner.new_table()
    table.ensure_slots(4)
    with pytest.raises(ValueError, match="trees over linear attention"):
        runner.forward([Window(table, [1, 2, 3], 3, parents=[-1, 0, 0])])


def test_the_ring_reuses_stale_entries_first_and_marks_writes_before_they_happen():
    cache = RecurrentStateCache(StateSpec(1, 4, 2, 1, 2, 2), num_slots=1, depth=4)
    slot = cache.pool.allocate()
    cache.batch([slot], [0], [6]).commit()
    assert cache.positions[slot] == [3, 4, 5, 6]
    batch = cache.batch([slot], [4], [6])  # rolled back to 4: 5 and 6 rewritten over the stale 5, 6
    assert sorted(j for j, _ in batch.writes[0]) == [2, 3]
    assert cache.positions[slot] == [3, 4, -1, -1]  # a failed forward leaves no wrong claim
    batch.commit()
    assert cache.positions[slot] == [3, 4, 5, 6]
    cache.release(slot)
    assert cache.pool.num_free == 1 and cache.positions[slot] == [-1] * 4


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_gguf_as_llama_cpp_writes_it_gives_transformers_logits(kind, tmp_path, monkeypatch):
    """`qwen3next` / `qwen35` / `qwen35moe` files (norms as 1 + w, A as -exp(A_log), Qwen3-Next's
    projections split, Qwen3.5's value heads tiled: `write_hybrid_gguf`) load as the model they
    hold; teacher-forced logits over a prompt and its continuation are transformers'; greedy
    speculative (the file as its own draft) equals target-only."""
    from specdec import Engine, EngineConfig, SamplingParams
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.hybrid_models import write_hybrid_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tiny_tokenizer()
    hf = hybrid_hf_model(kind, vocab_size=len(tokenizer), linear_num_value_heads=4, linear_num_key_heads=2)
    path = tmp_path / f"{kind}.gguf"
    write_hybrid_gguf(hf, path, tokenizer)
    engine = Engine(EngineConfig(target=str(path), proposer="none", dtype="float32", num_blocks=64, block_size=4))
    ids = [5, 17, 33, 8, 61, 9, 42, 11, 70, 3, 25, 90, 14, 2, 66, 7]
    table = engine.target.new_table()
    table.ensure_slots(len(ids))
    got = engine.target.forward([Window(table, ids, len(ids))])
    assert (got - _hf_logits(hf, ids)).abs().max().item() < 1e-4
    table.free()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = engine.generate([ids[:7]], greedy)[0].token_ids
    spec = Engine(EngineConfig(target=str(path), draft=str(path), proposer="draft", dtype="float32", num_blocks=64,
                               block_size=4, adaptive_k=False, num_speculative_tokens=3))
    assert spec.generate([ids[:7]], greedy)[0].token_ids == plain
