"""GGUF files of the dense families, written as llama.cpp's converter writes them, load as the
model they hold and generate what transformers generates from the same weights (fp32, greedy):
target only and speculative with the model as its own draft, from a text prompt tokenized as a
user's is (led by the model's BOS)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.model_files import resolve_model

from specdec.target.tokenizer import load_tokenizer

from .gguf_models import spm_vocab, write_gguf

PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def _tiny_gemma3():
    """A Gemma 3 text model as its GGUF describes one: the query scale of its head size, the local
    rope base and the 5:1 sliding pattern Gemma 3 always has (the GGUF stores none of them)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        vocab_size=len(spm_vocab()[0]), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=4, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    model = tf.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # sharp logits, and norms away from their identity
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.2)
    return model


def _hf_greedy(hf, tokenizer, prompt: str, n: int) -> list[int]:
    ids = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_gemma3_gguf_loads_as_its_text_decoder_and_generates_as_transformers(tmp_path):
    hf = _tiny_gemma3()
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(hf, path)

    folder = resolve_model(str(path), progress=False)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.decode(tokenizer.encode(PROMPTS[1], add_special_tokens=False)) == PROMPTS[1]
    config = json.loads((folder / "config.json").read_text())
    # transformers maps the `gemma3` GGUF to the multimodal class; the file holds the text decoder
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["query_pre_attn_scalar"] == 32
    assert config["layer_types"].count("full_attention") == 1

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [_hf_greedy(hf, tokenizer, p, 8) for p in PROMPTS]
    for kw in (dict(proposer="none"), dict(draft=str(path), proposer="draft", num_speculative_tokens=3)):
        engine = Engine(EngineConfig(target=str(path), dtype="float32", num_blocks=64, block_size=4, **kw))
        assert engine.encode(PROMPTS[0])[0] == tokenizer.bos_token_id
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == expected, kw
