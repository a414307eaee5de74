"""`specdec generate` streams from a user's MoE GGUF with a dense GGUF draft (both tiny, written here
with the gguf package as llama.cpp lays them out), on the default bf16 path: the target's experts
quantized from the GGUF's stacked tensors and run by the expert kernel."""

from __future__ import annotations

import pytest

from specdec.api.cli import main
from specdec.target.quant import qgemm
from tests.target.conftest import build_tiny_tokenizer
from tests.target.moe_models import moe_hf_model, write_gguf


@pytest.mark.skipif(qgemm.unavailable_reason() is not None, reason="no C kernel")
def test_generate_streams_from_an_moe_gguf_with_a_draft(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, Qwen3Config

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    target = tmp_path / "tiny-qwen3moe.gguf"
    write_gguf(moe_hf_model("qwen3_moe", vocab_size=vocab, eos_token_id=tokenizer.eos_token_id), target, tokenizer, "Q8_0")
    draft_config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                               tie_word_embeddings=False)
    draft = tmp_path / "tiny-qwen3.gguf"
    write_gguf(AutoModelForCausalLM.from_config(draft_config).eval(), draft, tokenizer)
    args = ["generate", "def add(a, b):", "--target", str(target), "--draft", str(draft), "--max-tokens", "12",
            "--ignore-eos", "--temperature", "0", "--kv-cache-memory", "0.05", "--no-warmup"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "12 tokens" in err
    assert "experts (top 2 of 8) read a layer" in err and "per verify window" in err
    assert out.strip()
