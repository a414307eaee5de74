"""gpt-oss against transformers on tiny random configs: attention sinks, sliding-window layers
between full ones, YaRN rope, a router and experts with biases, the clamped SwiGLU; target-only
and speculative; and its GGUF (llama.cpp's names, gate and up split, MXFP4 experts)."""

from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.config import ModelConfig
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.test_model_parity import TOL, _hf_logits, assert_prefill_matches

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4], [20, 21, 22, 23, 24, 25]]
# YaRN from an original context of 8, so the prompts run past it; a low clamp, so it acts
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=8, rope_theta=150000.0)
_MODELS: dict = {}


def gpt_oss_config(**overrides):
    import transformers as tf

    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                 max_position_embeddings=256, rms_norm_eps=1e-5, rope_parameters=YARN, swiglu_limit=1.0,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return tf.GptOssConfig(**{**shape, **overrides})


def gpt_oss_model(seed: int = 0, **overrides):
    """A random transformers gpt-oss in fp32 (cached: tests only read it)."""
    from transformers import AutoModelForCausalLM

    key = (seed, repr(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(gpt_oss_config(**overrides), dtype=torch.float32)
        with torch.no_grad():  # sharp logits and routers, sinks and biases away from zero
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.5)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def test_config_reads_sinks_windows_and_the_experts_biases():
    config = ModelConfig.from_hf(gpt_oss_config())
    assert config.attention_sinks and config.o_bias and config.attention_bias
    assert config.sliding_windows == (4, None, 4, None)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk, moe.router_bias, moe.expert_bias, moe.swiglu_limit) == (
        4, 2, True, True, True, 1.0)
    assert not moe.plain_routing and not moe.plain_experts  # the C expert kernel steps aside
    assert "attention sinks" in config.c_loop_differences()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_matches_transformers(block_size):
    assert_prefill_matches(gpt_oss_model(), block_size, PROMPTS)


def test_sinks_change_the_answer():
    """With its sinks zeroed the model is another one: the test above would see them dropped."""
    hf = gpt_oss_model()
    model = from_hf(hf)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.zero_()
    runner = ModelRunner.build(model, block_size=4, num_blocks=32)
    table = runner.new_table()
    ids = PROMPTS[0]
    table.ensure_slots(len(ids))
    assert (runner.forward([Window(table, ids, len(ids))]) - _hf_logits(hf, ids)).abs().max().item() > 100 * TOL


def test_step_by_step_decode_with_a_rollback_matches_transformers():
    """Windows of 1..3 tokens past the sliding window, speculative tokens written then rolled back."""
    hf = gpt_oss_model()
    runner = ModelRunner.build(from_hf(hf), block_size=4, num_blocks=128)
    seqs = [list(p) for p in PROMPTS]
    tables = [runner.new_table() for _ in seqs]
    for t, s in zip(tables, seqs):
        t.ensure_slots(len(s))
    runner.forward([Window(t, list(s), 1) for t, s in zip(tables, seqs)])
    for step, width in enumerate([1, 3, 2, 3]):
        if step == 2:
            for t, s in zip(tables, seqs):
                t.ensure_slots(len(s) + 2)
            runner.forward([Window(t, [90, 91], 1) for t in tables])
            for t, s in zip(tables, seqs):
                t.truncate(len(s))
        windows = []
        for i, (t, s) in enumerate(zip(tables, seqs)):
            new = [30 + 7 * i + step + j for j in range(width)]
            s.extend(new)
            t.ensure_slots(len(s))
            windows.append(Window(t, new, len(new)))
        logits = runner.forward(windows)
        for s, w, ours in zip(seqs, windows, torch.split(logits, [len(w.token_ids) for w in windows])):
            assert (ours - _hf_logits(hf, s)[-len(w.token_ids):]).abs().max().item() < TOL, step


def test_greedy_tokens_equal_transformers_generate_target_only_and_speculative():
    hf = gpt_oss_model()
    target, draft = from_hf(hf), from_hf(gpt_oss_model(seed=1, num_hidden_layers=2))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            expected.append(hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(prompt):].tolist())
    for proposer in ("none", "draft"):
        config = EngineConfig(dtype="float32", num_blocks=96, block_size=4, proposer=proposer,
                              num_speculative_tokens=3, adaptive_k=False)
        outs = Engine.from_models(config, target, draft if proposer == "draft" else None).generate(PROMPTS, greedy)
        assert [o.token_ids for o in outs] == expected, proposer


def _on_the_mxfp4_grid(hf):
    """A copy of `hf` whose experts' weights are their MXFP4 round trip (which MXFP4 then holds exactly)."""
    import copy

    import gguf
    from gguf import quants

    hf = copy.deepcopy(hf)
    fmt = gguf.GGMLQuantizationType.MXFP4
    for layer in hf.model.layers:
        for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            w = param.data.transpose(-1, -2).contiguous().numpy()  # [E, out, in]: blocks along the input
            grid = quants.dequantize(quants.quantize(w, fmt), fmt)
            assert (quants.dequantize(quants.quantize(grid, fmt), fmt) == grid).all()
            param.data.copy_(torch.from_numpy(grid).transpose(-1, -2))
    return hf


@pytest.mark.parametrize("experts", ["f32", "mxfp4"])
def test_gguf_generates_as_transformers_target_only_and_speculative(tmp_path, monkeypatch, experts):
    """A gpt-oss GGUF as llama.cpp's converter writes one with float experts (gate and up split from
    the interleaved pairs, sinks, biases, YaRN keys) loads as gpt-oss and generates transformers'
    tokens. YaRN as llama.cpp runs it: the correction range truncated to whole dims (the file keeps
    no `truncate`), and the SwiGLU clamp at gpt-oss's 7 (llama.cpp's constant: the file keeps none).
    Before: the file's sliding window was dropped (transformers' default of 128 ran instead)."""
    import json

    from specdec.target.model_files import resolve_model
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.gguf_models import write_gpt_oss_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tiny_tokenizer(chat_template=None)
    yarn = {k: v for k, v in YARN.items() if k != "truncate"}
    hf = gpt_oss_model(vocab_size=len(tokenizer), rope_parameters=yarn, swiglu_limit=7.0, seed=2)
    if experts == "mxfp4":
        hf = _on_the_mxfp4_grid(hf)
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(hf, path, tokenizer, mxfp4_experts=experts == "mxfp4")
    from gguf import GGUFReader

    stored = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert stored["blk.0.ffn_down_exps.weight"] == experts.upper() and stored["blk.0.ffn_gate_exps.bias"] == "F32"
    config = json.loads((resolve_model(str(path), progress=False) / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["intermediate_size"]) == ("gpt_oss", 4, 32)
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["sliding_window"] == 4
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    for kw in (dict(proposer="none"), dict(draft=str(path), proposer="draft", num_speculative_tokens=3)):
        engine = Engine(EngineConfig(target=str(path), dtype="float32", num_blocks=96, block_size=4, **kw))
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == expected, kw
