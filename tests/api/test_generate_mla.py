"""`specdec generate` streams from a user's DeepSeek GGUF (multi-head latent attention over a
mixture of experts; tiny, written here as llama.cpp lays it out) with a small dense GGUF draft, on
the default bf16 path: the latent cache, the absorbed attention in C for decode and verify."""

from __future__ import annotations

import pytest

from specdec.api.cli import main
from specdec.cache import cpu_attention
from tests.target.conftest import build_tiny_tokenizer
from tests.target.mla_models import mla_hf_model, write_gguf
from tests.target.moe_models import write_gguf as write_dense_gguf


@pytest.mark.skipif(cpu_attention.load_attention() is None, reason="no C attention kernel")
def test_generate_streams_from_a_deepseek2_gguf_with_a_draft(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, Qwen3Config

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    target = tmp_path / "tiny-deepseek2.gguf"
    write_gguf(mla_hf_model("v2", vocab_size=vocab, eos_token_id=tokenizer.eos_token_id), target, tokenizer, split_kv_b=True)
    draft_config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                               tie_word_embeddings=False)
    draft = tmp_path / "tiny-qwen3.gguf"
    write_dense_gguf(AutoModelForCausalLM.from_config(draft_config).eval(), draft, tokenizer)
    args = ["generate", "def add(a, b):", "--target", str(target), "--draft", str(draft), "--max-tokens", "12",
            "--ignore-eos", "--temperature", "0", "--kv-cache-memory", "0.05", "--no-warmup"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "12 tokens" in err
    assert "experts (top 2 of 8) read a layer" in err
    assert out.strip()
