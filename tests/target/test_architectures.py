"""Qwen3, Llama 3.x, Gemma 2 / 3, Phi-3 and Mistral with its sliding window against transformers
on tiny random configs (fp32): prefill and step-by-step decode through the paged cache within
1e-4 of transformers' logits, and speculative greedy output equal to transformers' `generate`.

The configs make every feature bite: windows of 4-5 tokens under prompts of up to 15, soft caps
near the logits' scale, norm weights away from their identity, distinct local and global rope.
"""

import logging

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.config import ModelConfig, UnsupportedModelError
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.test_model_parity import TOL, _hf_logits, assert_prefill_matches

VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4], [20, 21, 22, 23, 24, 25]]
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=500000.0)


def _longrope(head_dim: int) -> dict:
    half = head_dim // 2
    return dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                short_factor=[1.0 + 0.1 * i for i in range(half)], long_factor=[2.0 + i for i in range(half)])


def hf_config(arch: str):
    """A tiny transformers config of `arch` with every feature of the family switched on."""
    import transformers as tf

    shape = dict(SHAPE)
    if arch == "qwen3":
        return tf.Qwen3Config(**shape, head_dim=32)
    if arch == "llama3":
        return tf.LlamaConfig(**shape, rope_parameters=LLAMA3_ROPE)
    if arch == "gemma2":
        return tf.Gemma2Config(**shape, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                               attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if arch == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
        return tf.Gemma3TextConfig(**shape, head_dim=32, query_pre_attn_scalar=20, sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    if arch == "phi3":
        return tf.Phi3Config(**shape, sliding_window=5)
    if arch == "phi3-longrope":
        return tf.Phi3Config(**shape, original_max_position_embeddings=64, rope_parameters=_longrope(16))
    if arch == "mistral-window":
        return tf.MistralConfig(**shape, sliding_window=4)
    raise AssertionError(arch)


ARCHS = ["qwen3", "llama3", "gemma2", "gemma3", "phi3", "phi3-longrope", "mistral-window"]
_MODELS: dict = {}


def hf_model(arch: str, seed: int = 0, num_hidden_layers: int | None = None):
    """A random transformers model of `arch` in fp32 (cached: tests only read it)."""
    from transformers import AutoModelForCausalLM

    key = (arch, seed, num_hidden_layers)
    if key not in _MODELS:
        torch.manual_seed(seed)
        config = hf_config(arch)
        if num_hidden_layers is not None:
            config.num_hidden_layers = num_hidden_layers
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:num_hidden_layers]
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # sharp logits, and norms (q/k norms too) away from their identity
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.2)
        _MODELS[key] = model.eval()
    return _MODELS[key]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_batch_matches_transformers(arch, block_size):
    assert_prefill_matches(hf_model(arch), block_size, PROMPTS)


@pytest.mark.parametrize("arch", ARCHS)
def test_step_by_step_decode_matches_transformers(arch):
    """Prefill, then windows of 1..3 tokens per sequence (as verification feeds them), with a
    rollback: past the windows, so the sliding layers see only part of the cache."""
    hf = hf_model(arch)
    runner = ModelRunner.build(from_hf(hf), block_size=4, num_blocks=128)
    continuations = [list(range(30 + 10 * i, 40 + 10 * i)) for i in range(len(PROMPTS))]
    tables = [runner.new_table() for _ in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    for t, s in zip(tables, seqs):
        t.ensure_slots(len(s))
    runner.forward([Window(t, list(s), 1) for t, s in zip(tables, seqs)])
    for step, width in enumerate([1, 3, 2, 3, 1]):
        if step == 2:  # speculative tokens, then rejected: written to the cache, then rolled back
            for t, s in zip(tables, seqs):
                t.ensure_slots(len(s) + 2)
            runner.forward([Window(t, [90, 91], 1) for t in tables])
            for t, s in zip(tables, seqs):
                t.truncate(len(s))
        windows = []
        for t, s, cont in zip(tables, seqs, continuations):
            new = cont[:width]
            del cont[:width]
            s.extend(new)
            t.ensure_slots(len(s))
            windows.append(Window(t, new, len(new)))
        logits = runner.forward(windows)
        for s, w, ours in zip(seqs, windows, torch.split(logits, [len(w.token_ids) for w in windows])):
            ref = _hf_logits(hf, s)[-len(w.token_ids):]
            assert (ours - ref).abs().max().item() < TOL, f"step {step}"


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_transformers_generate(arch):
    """A draft of the same family (another random net, one layer) at k = 3 through the engine:
    the output is transformers' greedy `generate`, token for token."""
    hf = hf_model(arch)
    target, draft = from_hf(hf), from_hf(hf_model(arch, seed=1, num_hidden_layers=1))
    new_tokens = 16
    config = EngineConfig(dtype="float32", num_blocks=64, block_size=4, proposer="draft",
                          num_speculative_tokens=3, adaptive_k=False)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours = [o.token_ids for o in Engine.from_models(config, target, draft).generate(PROMPTS, greedy)]
    for prompt, out in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out == ref
