"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) against transformers on tiny
random configs, the expert kernel's row invariance, speculation on an MoE target, and MoE GGUFs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.config import ModelConfig
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model
from specdec.target.moe import SparseMoE
from specdec.target.quant import qgemm
from specdec.target.quant.convert import prepare_quantized, quantize_model
from specdec.target.quant.decoder_stack import NativeDecoderStack
from specdec.target.quant.moe_kernel import NativeMoE
from specdec.target.quant.qlinear import dequantize
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.conftest import build_tiny_tokenizer
from tests.target.moe_models import FAMILIES, moe_hf_config, moe_hf_model, write_gguf
from tests.target.test_model_parity import TOL, _hf_logits, assert_prefill_matches

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4], [20, 21, 22, 23, 24, 25]]
SEED = 0  # the expert-kernel parity test's input
needs_kernel = pytest.mark.skipif(qgemm.unavailable_reason() is not None, reason=f"no C kernel: {qgemm.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def test_configs_read_each_familys_routing_and_sparse_layers():
    qwen3 = ModelConfig.from_hf(moe_hf_config("qwen3_moe")).moe
    assert (qwen3.num_experts, qwen3.top_k, qwen3.expert_size, qwen3.norm_topk) == (8, 2, 32, True)
    assert qwen3.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    qwen2 = ModelConfig.from_hf(moe_hf_config("qwen2_moe", decoder_sparse_step=2)).moe
    assert (qwen2.shared_expert_size, qwen2.norm_topk, qwen2.sparse_layers) == (64, False, (False, True, False))
    assert ModelConfig.from_hf(moe_hf_config("mixtral")).moe.norm_topk  # always renormalized
    olmoe = ModelConfig.from_hf(moe_hf_config("olmoe"))
    assert olmoe.qk_norm_full and olmoe.clip_qkv == 4.0 and not olmoe.moe.norm_topk
    assert ModelConfig.from_hf(moe_hf_config("qwen3_moe")).llama_layer_differences() == ["q/k norms"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_transformers(family, block_size):
    assert_prefill_matches(moe_hf_model(family), block_size, PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_32_greedy_tokens_equal_transformers_generate(family):
    """Target-only and speculative (an MoE draft of the same family, k = 3) through the engine."""
    hf = moe_hf_model(family)
    target, draft = from_hf(hf), from_hf(moe_hf_model(family, seed=1, num_hidden_layers=1))
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for proposer in ("none", "draft"):
        config = EngineConfig(dtype="float32", num_blocks=96, block_size=4, proposer=proposer,
                              num_speculative_tokens=3, adaptive_k=False)
        outs = Engine.from_models(config, target, draft if proposer == "draft" else None).generate(PROMPTS, greedy)
        for prompt, out in zip(PROMPTS, outs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
            assert out.token_ids == ref, proposer


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_folder_loads_as_transformers_saved_it(tmp_path, family):
    """`save_pretrained` writes per-expert linears (Mixtral: `block_sparse_moe.experts.{e}.w1/w2/w3`)."""
    hf = moe_hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf", torch.float32)
    ids = PROMPTS[0]
    runner = ModelRunner.build(model, block_size=4, num_blocks=16)
    table = runner.new_table()
    table.ensure_slots(len(ids))
    assert (runner.forward([Window(table, ids, len(ids))]) - _hf_logits(hf, ids)).abs().max().item() < TOL


def _quantized(family: str, seed: int = 0, **overrides):
    """A bf16 w4a8 model of `family`, fused and packed, with its MoE blocks on the C kernel."""
    model = from_hf(moe_hf_model(family, seed, **overrides)).to(torch.bfloat16)
    quantize_model(model, "w4a8", progress=False)
    prepare_quantized(model)
    ModelRunner.build(model, 4, num_blocks=8)  # gives the blocks their kernels
    return model


@needs_kernel
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_a_rows_result_is_bitwise_the_one_row_call(family, simd_level):
    """Row i of an n-row MoE call (n = 1..16) equals the one-row call, bit for bit: the property
    that makes greedy speculation equal target-only decoding. And with 1, 2 or 3 threads alike:
    a one-row call runs its experts' downs one per thread where the threads divide the top k
    (qwen3_moe's 2 at 2 threads, qwen2_moe's 3 at 3), over all threads elsewhere."""
    block = _quantized(family).model.layers[0].mlp
    assert isinstance(block.kernel, NativeMoE)
    x, residual = torch.randn(16, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        singles = [block(x[i : i + 1], None, residual[i : i + 1]) for i in range(16)]
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert all(torch.equal(block(x[i : i + 1], None, residual[i : i + 1]), singles[i]) for i in range(16)), t
            for n in range(1, 17):
                out = block(x[:n], None, residual[:n])
                assert torch.equal(out, torch.cat(singles[:n])), (t, n)
    finally:
        torch.set_num_threads(threads)
    assert block.last_expert_ids.shape == (16, block.top_k)


@needs_kernel
def test_a_nan_row_still_chooses_k_distinct_experts_and_spares_the_others():
    """Overflowed activations make a row NaN: the kernel still picks top_k distinct experts in range
    for it (no index outside the expert table) and the other rows come out as without it."""
    block = _quantized("qwen2_moe").model.layers[0].mlp
    x = torch.randn(3, 64).bfloat16()
    clean = block(x, None, None)
    x[1] = float("nan")
    out = block(x, None, None)
    ids = block.last_expert_ids.tolist()
    assert all(len(set(row)) == block.top_k and all(0 <= e < block.num_experts for e in row) for row in ids)
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


@needs_kernel
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_expert_kernel_computes_what_the_torch_block_does(family):
    """The C block (fp32 inside) against the torch loop over the same quantized experts (bf16
    between ops): the same experts chosen, outputs within bf16 rounding. A seeded input: the two
    routers round differently, and an unseeded one drew a row at a near-tie once in a CI run."""
    model = _quantized(family)
    layer = model.model.layers[0]
    block, norm = layer.mlp, layer.post_attention_layernorm
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    native = block(x, norm, x)
    native_ids = block.last_expert_ids.long()
    kernel, block.kernel = block.kernel, None
    reference = block(x, norm, x)
    block.kernel = kernel
    assert torch.equal(native_ids.sort(-1).values, block.last_expert_ids.sort(-1).values)
    assert (native.float() - reference.float()).abs().max() < 0.05 * reference.float().abs().max()


@needs_kernel
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "qwen3_moe"])
def test_c_layer_loop_runs_moe_layers_bitwise_as_the_python_loop(family, simd_level):
    """Qwen2-MoE, Mixtral and Qwen3-MoE (its per-head q/k norms in C too) run whole in decoder.c,
    MoE layers included; the Python loop (each block's moe_block call) gives the same bits. (Qwen3's
    norms sum squares in C in order, torch in its own order: equal up to a rare last-bit
    difference, so there the logits are compared within bf16 rounding.)"""
    model = _quantized(family, num_attention_heads=2)  # head_dim 32: the C attention's
    runner = ModelRunner.build(model, 4, num_blocks=32)
    assert isinstance(model._layer_stack, NativeDecoderStack)

    def steps():
        a, b = runner.new_table(), runner.new_table()
        a.ensure_slots(30), b.ensure_slots(30)
        out = [runner.forward([Window(a, list(range(3, 20)), 1)])]
        out.append(runner.forward([Window(b, list(range(40, 49)), 1), Window(a, [7], 1)]))
        out.append(runner.forward([Window(a, [8, 9, 10, 11, 12], 5), Window(b, [50, 51], 2)]))
        return out

    native = steps()
    native_ids = model.model.layers[0].mlp.last_expert_ids.clone()
    model.use_layer_stack(None)
    for c, python in zip(native, steps()):
        if family == "qwen3_moe":
            assert (c - python).abs().max() <= 0.02 * python.abs().max()
        else:
            assert torch.equal(c, python)
    assert family == "qwen3_moe" or torch.equal(native_ids, model.model.layers[0].mlp.last_expert_ids)


@needs_kernel
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe"])
def test_bf16_speculative_greedy_equals_target_only_on_the_expert_kernel(family, simd_level):
    target, draft = _quantized(family), _quantized(family, seed=1, num_hidden_layers=1)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(**kw):
        config = EngineConfig(dtype="bfloat16", num_blocks=64, block_size=4, adaptive_k=False, **kw)
        return [o.token_ids for o in Engine.from_models(config, target, draft).generate(PROMPTS, greedy)]

    assert run(proposer="draft", num_speculative_tokens=4) == run(proposer="none")


@needs_kernel
def test_experts_that_do_not_fit_the_kernel_run_in_torch():
    """An expert width off the tile grid (48: down's input not a multiple of 32) keeps its down
    projection dense and the block its torch forward, which computes the same block."""
    hf = moe_hf_model("qwen3_moe", moe_intermediate_size=48)
    model = from_hf(hf)
    quantize_model(model, "w4a8", progress=False)
    prepare_quantized(model)
    ModelRunner.build(model, 4, num_blocks=8)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoE) and block.kernel is None
    assert type(block.gate).__name__ == "Router"  # never quantized
    assert all(type(e.down_proj) is torch.nn.Linear for e in block.experts)  # gate|up fit: int4
    dense = from_hf(hf).model.layers[0].mlp
    with torch.no_grad():  # the dense block with the int4 grid's gate|up weights
        for ours, twin in zip(block.experts, dense.experts):
            gate, up = dequantize(ours.gate_up_proj).chunk(2)
            twin.gate_proj.weight.copy_(gate), twin.up_proj.weight.copy_(up)
        x = torch.randn(7, 64)
        error = (block(x) - dense(x)).norm() / dense(x).norm()
    assert error.item() < 0.03  # what int8 activations cost, no more


# what a family's GGUF can hold: llama.cpp's OLMoE converter writes no clip_qkv and an eps of 1e-5,
# and its graph wants as many k heads as q heads (whole-width norms of the same size)
_GGUF_OVERRIDES = {"olmoe": dict(clip_qkv=None, rms_norm_eps=1e-5, num_key_value_heads=2)}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_gguf_with_stacked_experts_gives_its_hf_folders_logits(tmp_path, family):
    """A tiny MoE written to GGUF as llama.cpp lays it out (stacked `ffn_*_exps`, the shared
    expert's `*_shexp`, a dense layer among sparse ones; Mixtral as the llama architecture with
    experts and permuted q/k rows; OLMoE's q/k as stored, their whole-width norms) loads with the
    same logits as its HF folder (F32), and Q8_0 experts slice per expert into exactly gguf's
    dequantized values."""
    tokenizer = build_tiny_tokenizer()
    hf = moe_hf_model(family, vocab_size=len(tokenizer), **_GGUF_OVERRIDES.get(family, {}))
    ids = list(range(3, 30))
    for expert_type in ("F32", "Q8_0"):
        path = tmp_path / f"tiny-{family}-{expert_type}.gguf"
        write_gguf(hf, path, tokenizer, expert_type)
        model = load_model(resolve_model(str(path), progress=False), torch.float32)
        reference = _with_gguf_experts(hf, path) if expert_type != "F32" else hf
        runner = ModelRunner.build(model, 4, num_blocks=16)
        table = runner.new_table()
        table.ensure_slots(len(ids))
        logits = runner.forward([Window(table, ids, len(ids))])
        assert (logits - _hf_logits(reference, ids)).abs().max().item() < TOL, expert_type


def test_olmoe_gguf_generates_what_transformers_generates(tmp_path):
    """llama.cpp's `olmoe` GGUF (qwen2moe's keys, its feed_forward_length the experts' width) reads
    as OLMoE as llama.cpp runs it (no clipping, the top k's weights not renormalized) and generates
    transformers' greedy tokens, target only and speculative with itself as its draft (fp32)."""
    import json

    tokenizer = build_tiny_tokenizer()
    hf = moe_hf_model("olmoe", vocab_size=len(tokenizer), **_GGUF_OVERRIDES["olmoe"])
    path = tmp_path / "tiny-olmoe.gguf"
    write_gguf(hf, path, tokenizer)
    config = json.loads((resolve_model(str(path), progress=False) / "config.json").read_text())
    assert config["architectures"] == ["OlmoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 32)
    assert config["clip_qkv"] is None and config["norm_topk_prob"] is False
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    for kw in (dict(proposer="none"), dict(draft=str(path), proposer="draft", num_speculative_tokens=3)):
        engine = Engine(EngineConfig(target=str(path), dtype="float32", num_blocks=64, block_size=4,
                                     adaptive_k=False, **kw))
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == expected, kw


def _with_gguf_experts(hf, path):
    """A copy of `hf` whose stacked experts are the GGUF file's, dequantized by the gguf package."""
    import copy

    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    twin = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(twin.model.layers):
            if f"blk.{i}.ffn_gate_exps.weight" in tensors:
                gate, up = (torch.from_numpy(np.array(tensors[f"blk.{i}.ffn_{w}_exps.weight"])) for w in ("gate", "up"))
                layer.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
                layer.mlp.experts.down_proj.copy_(torch.from_numpy(np.array(tensors[f"blk.{i}.ffn_down_exps.weight"])))
    return twin
