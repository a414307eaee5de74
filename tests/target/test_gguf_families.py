"""GGUF files of the dense families, written as llama.cpp's converter writes them, load as the
model they hold and generate what transformers generates from the same weights (fp32, greedy):
target only and speculative with the model as its own draft, from a text prompt tokenized as a
user's is (led by the model's BOS)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.model_files import resolve_model

from specdec.target.tokenizer import load_tokenizer

from .conftest import build_tiny_tokenizer
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


LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16, rope_theta=500000.0)
LONG_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "def add(a, b):\n    return a + b\n" * 3]


def _tiny_llama31(tokenizer):
    """Llama 3.1's rope scaling with an original context of 16, so prompts of ~30 tokens run past it."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters=LLAMA31_ROPE, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
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


def test_llama31_gguf_keeps_its_rope_scaling_past_the_original_context(tmp_path):
    """llama.cpp writes Llama 3.1+'s rope scaling only as `rope_freqs.weight`: read back into
    config.json's rope_parameters, the model matches transformers past the original 16 positions
    (without it the rotations there differ)."""
    tokenizer = build_tiny_tokenizer(chat_template=None)
    hf = _tiny_llama31(tokenizer)
    path = tmp_path / "tiny-llama31.gguf"
    write_gguf(hf, path, tokenizer)

    folder = resolve_model(str(path), progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"] == LLAMA31_ROPE
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = Engine(EngineConfig(target=str(path), proposer="none", dtype="float32", num_blocks=64, block_size=4))
    ids = [engine.encode(p) for p in LONG_PROMPTS]
    assert all(len(i) > 20 and i[0] == tokenizer.bos_token_id for i in ids)
    expected = [hf.generate(torch.tensor([i]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(i):].tolist()
                for i in ids]
    assert [o.token_ids for o in engine.generate(ids, greedy)] == expected


def test_a_gguf_tensor_nothing_reads_is_refused(tmp_path):
    """Run without a tensor it holds, a model would be another one: the load stops and names it."""
    import gguf

    from specdec.target.config import UnsupportedModelError
    from specdec.target.model_weights import load_model

    from .gguf_models import gguf_tensors

    tokenizer = build_tiny_tokenizer(chat_template=None)
    hf = _tiny_llama31(tokenizer)
    path = tmp_path / "extra.gguf"
    write_gguf(hf, path, tokenizer)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "with-extra.gguf"), arch="llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for name, values in {**gguf_tensors(hf), "blk.0.attn_sinks.weight": np.ones(4, np.float32)}.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = resolve_model(str(tmp_path / "with-extra.gguf"), progress=False)
    with pytest.raises(UnsupportedModelError, match="reads no tensor blk.0.attn_sinks.weight"):
        load_model(folder, torch.float32)


def _bad_files(tmp_path) -> dict[str, tuple]:
    """name -> (path, what the one-line error says) for the GGUFs a user may have at hand broken."""
    import gguf

    from .gguf_models import gguf_tensors

    tokenizer = build_tiny_tokenizer(chat_template=None)
    hf = _tiny_llama31(tokenizer)
    good = tmp_path / "good.gguf"
    write_gguf(hf, good, tokenizer)
    data = good.read_bytes()
    files = {}
    files["truncated"] = (tmp_path / "truncated.gguf", "is truncated: its tensors take")
    files["truncated"][0].write_bytes(data[: len(data) - 1000])
    files["header"] = (tmp_path / "header.gguf", "GGUF header is cut short")
    files["header"][0].write_bytes(data[:100])
    arch = b"\x05" + b"\x00" * 7 + b"llama"
    files["architecture"] = (tmp_path / "unknown-arch.gguf", "GGUF architecture 'llamb' is not supported")
    files["architecture"][0].write_bytes(data.replace(arch, arch[:-1] + b"b", 1))
    q8k = gguf.GGMLQuantizationType.Q8_K
    writer = gguf.GGUFWriter(str(tmp_path / "q8k.gguf"), arch="llama")
    writer.add_block_count(2)
    for name, values in gguf_tensors(hf).items():
        writer.add_tensor(name, values)
    writer.add_tensor("blk.0.ffn_extra.weight", np.zeros((1, 292), np.uint8), raw_dtype=q8k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    files["type"] = (tmp_path / "q8k.gguf", "blk.0.ffn_extra.weight is stored as Q8_K, a ggml type specdec has no reader for")
    return files


def test_a_broken_gguf_is_a_one_line_error_and_leaves_nothing_cached(tmp_path, capsys):
    from specdec.api.cli import main

    for kind, (path, says) in _bad_files(tmp_path).items():
        assert main(["generate", "hi", "--target", str(path), "--no-speculation", "--no-warmup"]) == 2, kind
        err = capsys.readouterr().err.strip()
        assert err.startswith("specdec: error:") and str(path.name) in err and says in " ".join(err.split()), (kind, err)
        assert "Traceback" not in err
        models = tmp_path / "cache" / "models"
        assert not models.exists() or not any(models.iterdir()), kind


def _tiny(kind: str, tokenizer):
    import transformers as tf

    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    if kind == "phi4-mini":  # 3/4 of each head turned, under longrope (specdec: its short factors,
        half = 6  # exact up to the original context, which caps the context: `config._max_positions`)
        shape["original_max_position_embeddings"] = 64
        rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                    partial_rotary_factor=0.75, short_factor=[1.0 + 0.1 * i for i in range(half)],
                    long_factor=[2.0 + i for i in range(half)])
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**shape, rope_parameters=rope, tie_word_embeddings=True))
    elif kind == "smollm3":  # llama.cpp's SmolLM3: every 4th layer without rope, as SmolLM3-3B
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**shape, no_rope_layer_interval=4, tie_word_embeddings=True))
    elif kind == "glm4":  # half of each head turned, in interleaved pairs; q/k/v biases; sandwich norms
        model = tf.Glm4ForCausalLM(tf.Glm4Config(**shape, head_dim=16, attention_bias=True))
    else:
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**shape, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                       attention_multiplier=0.03, logits_scaling=3.0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", ["smollm3", "granite", "phi4-mini", "glm4"])
def test_family_gguf_generates_as_transformers(tmp_path, kind):
    """SmolLM3, Granite and GLM-4 GGUFs, which transformers' GGUF loader has no table for (read as llama's
    keys plus what the family adds: no-rope layers, multipliers, GLM-4's rotary width and biases), and Phi-4-mini's partial rotary
    and longrope factors, which its table leaves out."""
    tokenizer = build_tiny_tokenizer(chat_template=None)
    hf = _tiny(kind, tokenizer)
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(hf, path, tokenizer)
    config = json.loads((resolve_model(str(path), progress=False) / "config.json").read_text())
    assert config["model_type"] == ("phi3" if kind == "phi4-mini" else kind)
    if kind == "phi4-mini":
        assert config["rope_parameters"]["partial_rotary_factor"] == 0.75
        assert config["rope_parameters"]["long_factor"] == hf.config.rope_parameters["long_factor"]
        assert config["rope_parameters"]["original_max_position_embeddings"] == 64
    elif kind == "smollm3":
        assert config["no_rope_layers"] == [1, 1, 1, 0]
    elif kind == "glm4":
        assert (config["head_dim"], config["rope_parameters"]["partial_rotary_factor"]) == (16, 0.5)
        assert config["attention_bias"] is True
    else:
        assert (config["residual_multiplier"], config["logits_scaling"]) == (pytest.approx(0.22), 3.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for kw in (dict(proposer="none"), dict(draft=str(path), proposer="draft", num_speculative_tokens=3)):
        engine = Engine(EngineConfig(target=str(path), dtype="float32", num_blocks=64, block_size=4, **kw))
        ids = [engine.encode(p) for p in (PROMPTS if kind == "phi4-mini" else LONG_PROMPTS)]
        expected = [hf.generate(torch.tensor([i]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(i):].tolist()
                    for i in ids]
        assert [o.token_ids for o in engine.generate(ids, greedy)] == expected, kw
