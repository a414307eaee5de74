"""Multi-head latent attention (DeepSeek-V2/V3) against transformers on tiny random configs: the
naive and absorbed paths, the latent cache, the C kernel's absorbed attention, speculation on an
MLA target, and `deepseek2` GGUFs."""

from __future__ import annotations

import pytest
import torch

from specdec.cache import BlockPool, BlockTable, build_attention_metadata, cpu_attention, paged_attention_ref
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target import mla
from specdec.target.config import ModelConfig
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.mla_models import VARIANTS, mla_hf_config, mla_hf_model
from tests.target.test_model_parity import TOL, _hf_logits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4], [20, 21, 22, 23, 24, 25]]
needs_attention_kernel = pytest.mark.skipif(cpu_attention.load_attention() is None,
                                            reason=f"no C attention: {cpu_attention.kernel().unavailable_reason()}")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def naive_only(monkeypatch):
    """Every window through the naive path (decompressed keys and values)."""
    monkeypatch.setattr(mla, "NAIVE_MIN_QUERY_LEN", 1)


def _prefill(model, prompts, block_size=4, num_blocks=128):
    runner = ModelRunner.build(model, block_size=block_size, num_blocks=num_blocks)
    tables = [runner.new_table() for _ in prompts]
    for table, p in zip(tables, prompts):
        assert table.ensure_slots(len(p))
    logits = runner.forward([Window(t, p, len(p)) for t, p in zip(tables, prompts)])
    return runner, tables, list(torch.split(logits, [len(p) for p in prompts]))


def test_configs_read_latent_attention_and_deepseek_routing():
    v2 = ModelConfig.from_hf(mla_hf_config("v2"))
    assert (v2.mla.kv_lora_rank, v2.mla.latent_dim, v2.mla.qk_head_dim, v2.mla.q_lora_rank) == (48, 64, 48, None)
    assert v2.mla.rope_interleave and v2.head_dim == 16  # the rotary tables cover the rope part
    assert v2.moe.sparse_layers == (False, True, True) and v2.moe.shared_expert_size == 64
    assert not v2.moe.shared_expert_gated and v2.moe.scoring == "softmax" and v2.moe.plain_routing
    grouped = ModelConfig.from_hf(mla_hf_config("v2-grouped")).moe
    assert (grouped.num_groups, grouped.topk_groups, grouped.group_score) == (4, 2, "max") and not grouped.plain_routing
    v3 = ModelConfig.from_hf(mla_hf_config("v3"))
    assert (v3.moe.scoring, v3.moe.score_bias, v3.moe.group_score, v3.moe.routed_scaling) == ("sigmoid", True, "top2", 2.5)
    assert v3.mla.q_lora_rank == 32 and v3.c_loop_differences() == []  # decoder.c runs latent layers
    assert not ModelConfig.from_hf(mla_hf_config("v3-plain-rope")).mla.rope_interleave
    assert v2.query_scale == pytest.approx(48**-0.5)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
                beta_fast=32, beta_slow=1)
    scaled = ModelConfig.from_hf(mla_hf_config("v3", rope_scaling=yarn))
    assert scaled.query_scale == pytest.approx(48**-0.5 * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", ["absorbed", "naive"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_transformers(variant, path, block_size, monkeypatch):
    if path == "naive":
        monkeypatch.setattr(mla, "NAIVE_MIN_QUERY_LEN", 1)
    hf = mla_hf_model(variant)
    _, _, rows = _prefill(from_hf(hf), PROMPTS, block_size)
    for p, ours in zip(PROMPTS, rows):
        assert (ours - _hf_logits(hf, p)).abs().max().item() < TOL


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_absorbed_equals_naive_over_a_cached_prefix(variant, monkeypatch):
    """Prefill in one call, then windows of 1..4 rows read the cached prefix: the absorbed path
    (latents as keys and values) and the naive one (decompressed) agree within 1e-5 in fp32."""
    model = from_hf(mla_hf_model(variant))
    out = {}
    for path, threshold in (("absorbed", 1 << 30), ("naive", 1)):
        monkeypatch.setattr(mla, "NAIVE_MIN_QUERY_LEN", threshold)
        runner, tables, _ = _prefill(model, PROMPTS)
        logits, fed = [], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
        for width in (1, 4, 2, 3):
            windows = []
            for t in tables:
                assert t.ensure_slots(t.num_computed + width)
                windows.append(Window(t, fed[:width], width))
            logits.append(runner.forward(windows))
        out[path] = torch.cat(logits)
    assert (out["absorbed"] - out["naive"]).abs().max().item() < 1e-5


def test_chunked_prefill_and_a_prefix_hit_give_the_one_call_logits():
    """A prompt in chunks (the later ones decompress the cached chunks before them) and a second
    request whose prompt starts with cached blocks give the logits of one whole prefill."""
    hf = mla_hf_model("v3")
    model, prompt = from_hf(hf), [3 + (7 * i) % 90 for i in range(150)]  # > NAIVE_MIN_QUERY_LEN: both paths
    whole = _hf_logits(hf, prompt)[-1]
    runner = ModelRunner.build(model, block_size=4, num_blocks=128)
    table = runner.new_table()
    for end in (70, 140, 150):  # naive, naive, absorbed
        assert table.ensure_slots(end)
        last = runner.forward([Window(table, prompt[table.num_computed:end], 1)])
    assert (last[0] - whole).abs().max().item() < TOL
    config = EngineConfig(dtype="float32", num_blocks=128, block_size=4, proposer="none", enable_prefix_caching=True)
    engine = Engine.from_models(config, model, None)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = engine.generate([prompt], greedy)[0]
    second = engine.generate([prompt], greedy)[0]
    assert second.num_cached_tokens >= 144 and second.token_ids == first.token_ids


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_64_greedy_tokens_equal_transformers_generate(variant):
    """Target-only and speculative (an MLA draft of the same family, k = 3) through the engine."""
    hf = mla_hf_model(variant)
    target, draft = from_hf(hf), from_hf(mla_hf_model(variant, seed=1, num_hidden_layers=2))
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    refs = []
    for prompt in PROMPTS:
        with torch.no_grad():
            refs.append(hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(prompt):].tolist())
    for proposer in ("none", "draft"):
        config = EngineConfig(dtype="float32", num_blocks=160, block_size=4, proposer=proposer,
                              num_speculative_tokens=3, adaptive_k=False)
        outs = Engine.from_models(config, target, draft if proposer == "draft" else None).generate(PROMPTS, greedy)
        assert [o.token_ids for o in outs] == refs, proposer


def test_the_pool_holds_one_latent_a_token_and_layer():
    """(rank + rope) x layers x dtype size bytes a token: 64 x 3 x 2 = 384 in bf16, where per-head
    keys and values would take 2 x 4 heads x 48 x 3 x 2 = 2,304 (6x)."""
    model = from_hf(mla_hf_model("v2")).to(torch.bfloat16)
    spec = ModelRunner.kv_spec(model, block_size=16)
    assert (spec.latent_rank, spec.num_kv_heads, spec.head_dim, spec.planes) == (48, 1, 64, 1)
    assert spec.bytes_per_token() == (48 + 16) * 3 * 2
    runner = ModelRunner.build(model, 16, num_blocks=10)
    assert runner.kv_cache.nbytes() == spec.bytes_per_token() * 16 * 10
    k, v = runner.kv_cache.layer(1)
    assert v.data_ptr() == k.data_ptr() and v.shape[-1] == 48  # the values are the latents' first rank dims


@pytest.mark.parametrize("path", ["absorbed", "naive"])
def test_an_fp8_latent_cache_stays_close(path, monkeypatch):
    """Latents stored in e4m3 (3 mantissa bits): every row's logits point where transformers'
    do (cosine > 0.99), through either path."""
    if path == "naive":
        monkeypatch.setattr(mla, "NAIVE_MIN_QUERY_LEN", 1)
    hf = mla_hf_model("v2")
    runner = ModelRunner.build(from_hf(hf), 4, kv_dtype=torch.float8_e4m3fn, num_blocks=64)
    table = runner.new_table()
    assert table.ensure_slots(len(PROMPTS[0]))
    logits = runner.forward([Window(table, PROMPTS[0], len(PROMPTS[0]))])
    cosine = torch.nn.functional.cosine_similarity(logits, _hf_logits(hf, PROMPTS[0]), dim=-1)
    assert cosine.min().item() > 0.99


def _latent_step(query_lens, seq_lens, heads=5, dim=80, block_size=4, seed=0):
    torch.manual_seed(seed)
    cache = torch.randn(48, block_size, 1, dim).bfloat16()
    pool = BlockPool(48)
    tables = [BlockTable(pool, block_size) for _ in seq_lens]
    for t, n in zip(tables, seq_lens):
        assert t.ensure_slots(n)
    meta = build_attention_metadata(tables, [n - q for n, q in zip(seq_lens, query_lens)], list(seq_lens), "cpu")
    return cache, tables, meta, torch.randn(meta.num_tokens, heads, dim).bfloat16()


@needs_attention_kernel
def test_latent_attend_matches_the_reference_and_a_rows_result_is_its_one_row_call(simd_level):
    """The C absorbed attention equals the torch reference (fp32 accumulation, bf16 out), and row i
    of a multi-row, multi-sequence call is bitwise the row alone, at 1 and 2 threads."""
    query_lens, seq_lens, rank = [1, 3, 4, 2], [10, 7, 21, 2], 64
    cache, tables, meta, q = _latent_step(query_lens, seq_lens)
    out = cpu_attention.latent_attend(q, cache, rank, meta, 0.1)
    ref = paged_attention_ref(q.float(), cache.float(), cache[..., :rank].float(), meta, 0.1)
    assert (out.float() - ref).abs().max().item() < 2e-2
    singles, row = [], 0
    for t, n, ql in zip(tables, seq_lens, query_lens):
        for i in range(ql):
            one = build_attention_metadata([t], [n - ql + i], [n - ql + i + 1], "cpu")
            singles.append(cpu_attention.latent_attend(q[row : row + 1].contiguous(), cache, rank, one, 0.1))
            row += 1
    assert torch.equal(torch.cat(singles), out)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(cpu_attention.latent_attend(q, cache, rank, meta, 0.1), out)
    finally:
        torch.set_num_threads(threads)


@needs_attention_kernel
def test_latent_attend_refuses_what_it_cannot_read():
    cache, _, meta, q = _latent_step([1], [5])
    with pytest.raises(ValueError, match="latent_attend"):
        cpu_attention.latent_attend(q, cache, 72, meta, 0.1)  # values wider than a multiple of 16 allows
    with pytest.raises(ValueError, match="query"):
        cpu_attention.latent_attend(q.float(), cache, 64, meta, 0.1)
    wide = torch.zeros(4, 4, 1, 1040).bfloat16()
    with pytest.raises(ValueError, match="up to 1024"):
        cpu_attention.latent_attend(q, wide, 64, meta, 0.1)


@needs_attention_kernel
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_bf16_speculation_on_the_c_kernel_equals_target_only(variant, monkeypatch):
    """bf16, the absorbed path on the C kernel: greedy speculative decoding (k = 4) gives target-only
    decoding's tokens, because each verify row is computed as a one-row step computes it."""
    calls = []
    attend = cpu_attention.latent_attend
    monkeypatch.setattr(cpu_attention, "latent_attend", lambda *a, **k: calls.append(a[0].shape[0]) or attend(*a, **k))
    target = from_hf(mla_hf_model(variant), torch.bfloat16)
    draft = from_hf(mla_hf_model(variant, seed=1, num_hidden_layers=2), torch.bfloat16)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for proposer in ("none", "draft"):
        config = EngineConfig(dtype="bfloat16", num_blocks=160, block_size=4, proposer=proposer,
                              num_speculative_tokens=4, adaptive_k=False, target_quant="none", draft_quant="none")
        engine = Engine.from_models(config, target, draft if proposer == "draft" else None)
        outs[proposer] = [o.token_ids for o in engine.generate(PROMPTS, greedy)]
    assert max(calls) > len(PROMPTS)  # verify windows of several rows ran on the kernel
    assert outs["draft"] == outs["none"]


@pytest.mark.parametrize("variant, split_kv_b", [("v2", False), ("v3", True), ("v2-grouped", True)])
def test_a_deepseek2_gguf_loads_with_its_hf_folders_logits(tmp_path, variant, split_kv_b):
    """A tiny `deepseek2` GGUF (llama.cpp's names and keys; `kv_b` whole, or split into `attn_k_b` /
    `attn_v_b` as llama.cpp's newer converter writes it; V3's router bias as `exp_probs_b`) loads
    with the logits of the transformers model it was written from."""
    from specdec.target.model_files import resolve_model
    from specdec.target.model_weights import load_model
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.mla_models import write_gguf

    tokenizer = build_tiny_tokenizer()
    hf = mla_hf_model(variant, vocab_size=len(tokenizer))
    path = tmp_path / f"tiny-{variant}.gguf"
    write_gguf(hf, path, tokenizer, split_kv_b=split_kv_b)
    model = load_model(resolve_model(str(path), progress=False), torch.float32)
    assert model.config.mla == ModelConfig.from_hf(hf.config).mla and model.config.moe == ModelConfig.from_hf(hf.config).moe
    ids = list(range(3, 30))
    _, _, (logits,) = _prefill(model, [ids])
    assert (logits - _hf_logits(hf, ids)).abs().max().item() < TOL


@pytest.mark.skipif(cpu_attention.load_attention() is None, reason="no C kernels")
def test_deepseek_v2_experts_and_ungated_shared_experts_run_on_the_expert_kernel():
    """V2's plain routing (softmax, top k, scale 1) with its ungated shared experts runs on the C
    expert kernel: a row's result is bitwise its one-row call, and the block is close to its torch
    forward on the same quantized experts; V3's routing keeps the torch block."""
    from specdec.target.quant.convert import prepare_quantized, quantize_model
    from specdec.target.quant.moe_kernel import NativeMoE

    def quantized(variant):
        model = from_hf(mla_hf_model(variant)).to(torch.bfloat16)
        quantize_model(model, "w4a8", progress=False)
        prepare_quantized(model)
        ModelRunner.build(model, 4, num_blocks=8)  # gives the blocks their kernels
        return model

    block = quantized("v2").model.layers[1].mlp
    assert isinstance(block.kernel, NativeMoE) and block.shared_expert_gate is None
    x, residual = torch.randn(8, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    singles = [block(x[i : i + 1], None, residual[i : i + 1]) for i in range(8)]
    out = block(x, None, residual)
    assert torch.equal(out, torch.cat(singles))
    kernel, block.kernel = block.kernel, None
    torch_out = block(x, None, residual)
    block.kernel = kernel
    assert (out.float() - torch_out.float()).abs().max().item() < 0.05 * torch_out.float().abs().max().item()
    assert quantized("v3").model.layers[1].mlp.kernel is None


def _quantized_v2(**overrides):
    from specdec.target.quant.convert import prepare_quantized, quantize_model

    model = from_hf(mla_hf_model("v2", **overrides)).to(torch.bfloat16)
    quantize_model(model, "w4a8", progress=False)
    prepare_quantized(model)
    return model


@needs_attention_kernel
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope", [16, 64])
def test_latent_write_and_query_compute_the_models_norm_and_rope_row_by_row(interleave, rope, simd_level):
    """`latent_write` (norm, rope, slot write) and `latent_query` (`W_UK`, rope) against the torch
    path they replace: every rotated value bitwise `apply_rope`'s (DeepSeek's interleaved pairs too),
    `q_nope . W_UK` bitwise `head_matmul`'s, the norm within one bf16 rounding of torch's (its sum
    of squares runs in order, torch's in its own); each row bitwise the same computed alone, at 1
    and 2 threads; a position off the rotary table refused before anything is written."""
    from specdec.target.layers import RMSNorm
    from specdec.target.rope import RotaryEmbedding

    query_lens, seq_lens, rank, heads, nope = [1, 3, 2], [6, 9, 2], 48, 3, 32
    cache, tables, meta, _ = _latent_step(query_lens, seq_lens, dim=rank + rope)
    t = meta.num_tokens
    rotary = RotaryEmbedding(mla_hf_config("v2"), rope, 64)
    positions = torch.tensor([p for n, q in zip(seq_lens, query_lens) for p in range(n - q, n)])
    rotation = rotary(positions, torch.bfloat16)
    norm = RMSNorm(rank, 1e-6)
    norm.weight.data = (torch.randn(rank) * 0.2 + 1).bfloat16()
    kv_a = torch.randn(t, 8 + rank + rope).bfloat16()[:, 8:]  # a strided view, as split leaves it
    q = torch.randn(t, heads * (nope + rope)).bfloat16()
    w_uk = (torch.randn(heads, nope, rank) * 0.2).bfloat16()
    flip = (lambda x: x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)) if interleave else (lambda x: x)
    cos, sin = rotation.cos_sin

    cpu_attention.latent_write(kv_a, norm.weight, norm.eps, interleave, rotation, cache, meta)
    written = cache.view(-1, rank + rope)[meta.slot_mapping]
    c, k_rope = kv_a.split([rank, rope], dim=-1)
    assert torch.equal(written[:, rank:], mla.apply_rope(flip(k_rope).unsqueeze(1), cos, sin).squeeze(1))
    ulps = (written[:, :rank].view(torch.int16).int() - norm(c).view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1 and (ulps == 0).float().mean().item() > 0.9

    query = cpu_attention.latent_query(q, w_uk, interleave, rotation, cache, meta)
    q_nope, q_rope = q.view(t, heads, nope + rope).split([nope, rope], dim=-1)
    assert torch.equal(query[..., :rank], cpu_attention.head_matmul(q_nope.contiguous(), w_uk, transposed=False))
    assert torch.equal(query[..., rank:], mla.apply_rope(flip(q_rope), cos, sin))

    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            row, before = 0, cache.clone()
            for table, length, ql in zip(tables, seq_lens, query_lens):
                for i in range(ql):
                    one = build_attention_metadata([table], [length - ql + i], [length - ql + i + 1], "cpu")
                    alone = rotary(positions[row : row + 1], torch.bfloat16)
                    cache.zero_()
                    cpu_attention.latent_write(kv_a[row : row + 1], norm.weight, norm.eps, interleave, alone, cache, one)
                    assert torch.equal(cache.view(-1, rank + rope)[one.slot_mapping], written[row : row + 1])
                    assert torch.equal(cpu_attention.latent_query(q[row : row + 1], w_uk, interleave, alone, cache, one),
                                       query[row : row + 1])
                    row += 1
            cache.copy_(before)
    finally:
        torch.set_num_threads(threads)
    before = cache.clone()
    far = rotary(torch.full((t,), rotation.cos_table.shape[0]), torch.bfloat16)  # one past the table
    with pytest.raises(Exception, match="latent_write"):
        cpu_attention.latent_write(kv_a, norm.weight, norm.eps, interleave, far, cache, meta)
    assert torch.equal(cache, before)


@needs_attention_kernel
@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_c_layer_loop_runs_latent_layers_bitwise_as_the_python_loop(q_lora_rank, simd_level):
    """A w4a8 DeepSeek-V2 (latent attention, a dense first layer, MoE layers on the expert kernel)
    runs whole in decoder.c for decode and verify windows, and gives the Python loop's bits; a
    window of `NAIVE_MIN_QUERY_LEN` rows or more (the naive path) leaves the step to Python."""
    from specdec.target.quant.decoder_stack import NativeDecoderStack

    model = _quantized_v2(q_lora_rank=q_lora_rank)
    runner = ModelRunner.build(model, 4, num_blocks=80)
    stack = model._layer_stack
    assert isinstance(stack, NativeDecoderStack)
    runs = []

    def steps():
        a, b = runner.new_table(), runner.new_table()
        a.ensure_slots(100), b.ensure_slots(30)
        out = [runner.forward([Window(a, list(range(3, 20)), 1)])]
        out.append(runner.forward([Window(b, list(range(40, 49)), 1), Window(a, [7], 1)]))
        out.append(runner.forward([Window(a, [8, 9, 10, 11, 12], 5), Window(b, [50, 51], 2)]))
        out.append(runner.forward([Window(a, [3 + i % 90 for i in range(70)], 2), Window(b, [52], 1)]))
        out.append(runner.forward([Window(a, [13, 14], 2), Window(b, [53], 1)]))
        return out

    real = stack.run
    stack.run = lambda *a: runs.append(real(*a)) or runs[-1]
    native = steps()
    assert runs == [True, True, True, False, True]
    model.use_layer_stack(None)
    for c, python in zip(native, steps()):
        assert torch.equal(c, python)


@needs_attention_kernel
def test_w4a8_speculation_through_the_c_layer_loop_equals_target_only():
    """Greedy speculative decoding (k = 4) on a w4a8 MLA target whose steps run in decoder.c gives
    target-only decoding's tokens: each verify row is computed as a one-row step computes it."""
    from specdec.target.quant.decoder_stack import NativeDecoderStack

    target, draft = _quantized_v2(q_lora_rank=32), _quantized_v2(q_lora_rank=32, num_hidden_layers=2)
    ran = []
    real = NativeDecoderStack.run
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NativeDecoderStack, "run", lambda self, h, *a: ran.append(h.shape[0]) or real(self, h, *a))
        for proposer in ("none", "draft"):
            config = EngineConfig(dtype="bfloat16", num_blocks=160, block_size=4, proposer=proposer,
                                  num_speculative_tokens=4, adaptive_k=False, target_quant="none", draft_quant="none")
            engine = Engine.from_models(config, target, draft if proposer == "draft" else None)
            outs[proposer] = [o.token_ids for o in engine.generate(PROMPTS, greedy)]
    assert max(ran) > len(PROMPTS)  # verify windows of several rows ran in C
    assert outs["draft"] == outs["none"]
