"""The MoE speed tools: the synthetic checkpoint loads as the model it claims to be, and the
side-by-side table reads its figures right."""

from __future__ import annotations

import torch

from specdec.eval import moe_bench, moe_synthetic
from specdec.target.model_weights import load_model
from specdec.target.moe import SparseMoE


def test_the_synthetic_checkpoint_has_qwen3_moe_layers(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    small = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    folder = moe_synthetic.write_checkpoint(tmp_path / "hf", 2, tokenizer_dir, **small)
    model = load_model(folder, torch.float32)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    block = model.model.layers[1].mlp
    assert (block.num_experts, block.top_k, block.norm_topk) == (8, 2, True)
    assert block.experts[7].down_proj.weight.shape == (64, 32)
    assert model.config.qk_norm and not model.config.tie_word_embeddings


def test_the_synthetic_deepseek_checkpoint_has_v2_lite_layers(tmp_path):
    """`--shape deepseek-v2-lite`: latent attention, a dense first layer, then experts with
    ungated shared experts (a small copy of the shape)."""
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                 num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
                 rope_scaling=None, q_lora_rank=16)
    folder = moe_synthetic.write_checkpoint(tmp_path / "hf", 3, tokenizer_dir, base=moe_synthetic.DEEPSEEK_V2_LITE, **small)
    model = load_model(folder, torch.float32)
    layers = model.model.layers
    assert not isinstance(layers[0].mlp, SparseMoE) and all(isinstance(layer.mlp, SparseMoE) for layer in layers[1:])
    assert model.config.mla.latent_dim == 48 and layers[1].mlp.shared_expert_gate is None
    assert layers[2].mlp.shared_expert.down_proj.weight.shape == (64, 64)


def test_the_table_puts_each_engine_beside_the_other():
    forwards = {r: 0.01 * (1 + r / 4) for r in moe_bench.ROWS}
    ours = {"tg128": 30.0, "pp512": 300.0, "forward_s": forwards, "experts": {r: 8.0 + r for r in moe_bench.ROWS}}
    llama = {"tg128": 25.0, "pp512": 150.0, "forward_s": {r: 0.01 * r for r in moe_bench.ROWS}}
    text = moe_bench.table(ours, llama)
    assert "| one-row decode, tok/s (tg128) | 30.0 | 25.0 | 1.20x |" in text
    assert "| prefill 512, tok/s (pp512) | 300.0 | 150.0 | 2.00x |" in text
    assert "| 6-row forward, ms (x its own 1-row) | 25.0 (2.00x) | 60.0 (6.00x) | 0.33 |" in text
    assert "| distinct experts a layer | 9.0 | 10.0 | 12.0 | 14.0 | 16.0 |" in text
    alone = moe_bench.table(ours, None)  # llama.cpp not run: no figure, no ratio
    assert "| one-row decode, tok/s (tg128) | 30.0 | - | |" in alone and "0.00x" not in alone
