"""The w4a8 kernel (`qgemm.c` via `QLinear`): what it computes, batch invariance, fusion, caching."""

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine_parts import draft_default, resolve_config
from specdec.target.quant import qgemm
from specdec.target.quant.convert import quantize_model
from specdec.target.quant.decoder_stack import NativeDecoderStack
from specdec.target.quant.qlinear import QLinear, dequantize, fuse_qlinear, reference_qgemm
from specdec.target.model_weights import load_model
from specdec.testing import write_tiny_pair
from tests.target.test_quant import grid_weights
from tests.target.test_w8a8 import IDS, prompt_logits, speculative_and_plain_greedy

pytestmark = pytest.mark.skipif(
    qgemm.unavailable_reason() is not None, reason=f"w4a8 kernel unavailable: {qgemm.unavailable_reason()}"
)


def _linear(int4: bool, n: int = 64, k: int = 96, bias: bool = True, seed: int = 0) -> tuple[QLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = grid_weights(n, k, seed=seed) if int4 else torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    return QLinear.from_weight(w, b, int4_max_error=0.02), w


@pytest.mark.parametrize("int4", [True, False])
def test_tiles_take_int4_only_on_the_grid_and_reproduce_the_weights(int4):
    q, w = _linear(int4)
    assert set(q.tile_bits.tolist()) == {4 if int4 else 8}
    err = (dequantize(q) - w).norm() / w.norm()
    assert err < (0.01 if int4 else 0.01), err  # int4: bf16 steps on the grid; int8: 127 levels


@pytest.mark.parametrize("int4", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 40])
def test_kernel_computes_the_quantized_product(int4, dtype, rows, simd_level):
    q, w = _linear(int4)
    x = torch.randn(rows, q.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (rows, q.out_features)
    ref = reference_qgemm(x, q)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output cast
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # and close to the float product: activations lose ~0.5% per group of 32
    exact = x.float() @ w.t() + q.bias
    assert ((y.float() - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("int4", [True, False])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(int4, simd_level):
    """What makes speculative verification of k+1 rows equal k+1 one-row steps."""
    q, _ = _linear(int4)
    x = torch.randn(13, q.in_features, generator=torch.Generator().manual_seed(3))
    x[4] *= 100  # a far larger range must not change the other rows' quantization
    batched = q(x)  # rows in chunks of 6, 6, 1
    alone = torch.cat([q(x[i : i + 1]) for i in range(13)])
    assert torch.equal(batched, alone)
    assert torch.equal(q(x[2:7]), batched[2:7])


@pytest.mark.parametrize("int4", [True, False])
def test_row_i_of_n_rows_is_the_one_row_call_bitwise(int4, simd_level):
    """n = 1..16 rows and a prefill chunk's 31-40, with an RMSNorm, a SiLU-GLU or a residual fused in:
    every row of every call equals that row alone, at this level (the batch splits into chunks of
    `MAX_ROWS` and a rest; from 7 or 32 rows, by level, int4 tiles are unpacked once per call)."""
    q, _ = _linear(int4)
    g = torch.Generator().manual_seed(11)
    x, gate_up = torch.randn(40, 96, generator=g).bfloat16(), (torch.randn(40, 192, generator=g) * 4).bfloat16()
    norm, residual = torch.rand(96, generator=g).bfloat16() + 0.5, torch.randn(40, 64, generator=g).bfloat16()
    calls = {
        "plain": lambda rows: q(x[rows]),
        "norm": lambda rows: q(x[rows], norm_weight=norm, eps=1e-6),
        "glu": lambda rows: q(gate_up[rows], glu=True),
        "residual": lambda rows: q(x[rows], residual=residual[rows]),
    }
    for name, call in calls.items():
        alone = torch.cat([call(slice(i, i + 1)) for i in range(40)])
        for n in [*range(1, 17), 31, 32, 33, 40]:
            assert torch.equal(call(slice(0, n)), alone[:n]), (name, n)


def test_every_level_computes_bitwise_the_same(monkeypatch):
    """The AVX2 and AVX-VNNI builds return what the AVX-512 VNNI build returns, bit for bit (int4
    and int8 tiles, each fusion, 1 to 40 rows), so tokens do not depend on the CPU's level.
    Compares the levels this machine runs: all three on an AVX-512 VNNI CPU."""
    from tests.conftest import MACHINE_LEVELS

    if len(MACHINE_LEVELS) < 2:
        pytest.skip(f"one level runs here ({MACHINE_LEVELS}): nothing to compare")
    g = torch.Generator().manual_seed(12)
    x, gate_up = torch.randn(40, 96, generator=g), torch.randn(40, 192, generator=g) * 30
    norm, residual = torch.rand(96, generator=g) + 0.5, torch.randn(40, 64, generator=g)
    results = {}
    for level in MACHINE_LEVELS:
        monkeypatch.setenv("SPECDEC_ISA", level)
        out = []
        for int4 in (True, False):
            q, _ = _linear(int4)
            for rows in (1, 4, 5, 6, 7, 13, 40):
                for dtype in (torch.float32, torch.bfloat16):
                    a, b, r = x[:rows].to(dtype), gate_up[:rows].to(dtype), residual[:rows].to(dtype)
                    out += [q(a), q(b, glu=True), q(a, norm_weight=norm.to(dtype), eps=1e-6, residual=r)]
        results[level] = out
    first = MACHINE_LEVELS[0]
    for level in MACHINE_LEVELS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[first], results[level])), (first, level)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fused_into_the_kernel_matches_norm_then_linear(dtype, simd_level):
    from specdec.target.layers import RMSNorm, normed

    q, _ = _linear(True)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(96, generator=torch.Generator().manual_seed(5)) + 0.5).to(dtype)
    x = (torch.randn(7, 96, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    fused, unfused = normed(norm, q, x), q(norm(x))
    assert fused.dtype == dtype
    assert ((fused.float() - unfused.float()).norm() / unfused.float().norm()) < 0.01
    assert torch.equal(fused, torch.cat([normed(norm, q, x[i : i + 1]) for i in range(7)]))
    assert normed(None, q, x).equal(q(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_glu_fused_into_the_kernel_matches_silu_mul_then_linear(dtype, simd_level):
    from specdec.target.layers import plus_linear

    q, _ = _linear(True)
    gate_up = (torch.randn(7, 2 * 96, generator=torch.Generator().manual_seed(8)) * 4).to(dtype)
    gate_up[0, :96] = torch.tensor([-100.0, 100.0, 0.0] * 32)  # exp over- and underflow
    fused = q(gate_up, glu=True)
    gate, up = gate_up.float().chunk(2, -1)
    expected = reference_qgemm(torch.nn.functional.silu(gate) * up, q)  # silu in fp32, as the kernel
    assert fused.dtype == dtype and torch.isfinite(fused).all()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert torch.equal(fused, torch.cat([q(gate_up[i : i + 1], glu=True) for i in range(7)]))
    # the torch path of a linear without the fusion computes the same thing
    dense = torch.nn.Linear(96, 64).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(plus_linear(None, dense, gate_up, glu=True), dense(torch.nn.functional.silu(gate) * up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_added_in_the_kernel_is_bitwise_residual_plus_linear(dtype, simd_level):
    q, _ = _linear(False)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(9)).to(dtype)
    residual = (torch.randn(5, 64, generator=torch.Generator().manual_seed(10)) * 8).to(dtype)
    assert torch.equal(q(x, residual=residual), residual + q(x))
    assert torch.equal(residual, (torch.randn(5, 64, generator=torch.Generator().manual_seed(10)) * 8).to(dtype))


def test_fused_linear_equals_its_parts_bitwise_whatever_their_formats():
    parts = [_linear(True, n=32, seed=1)[0], _linear(False, n=48, bias=False, seed=2)[0], _linear(True, seed=3)[0]]
    fused = fuse_qlinear(parts)
    assert fused.tile_bits.tolist() == [4] * 2 + [8] * 3 + [4] * 4
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], -1))
    assert fuse_qlinear([parts[0], torch.nn.Linear(96, 16)]) is None
    assert fuse_qlinear([parts[0], _linear(True, k=64)[0]]) is None  # another input size


def test_empty_batch_and_leading_dimensions():
    q, _ = _linear(True)
    assert q(torch.zeros(0, 96)).shape == (0, 64)
    x = torch.randn(2, 3, 96)
    assert torch.equal(q(x), q(x.reshape(6, 96)).reshape(2, 3, 64))


def test_shapes_off_the_tiles_are_refused_or_left_dense():
    with pytest.raises(ValueError, match="out_features % 16"):
        QLinear.from_weight(torch.randn(24, 64), None, 0.02)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24))  # neither dimension fits: stays dense
    counts = quantize_model(model, "w4a8", progress=False)
    assert counts["dense"] == 1 and isinstance(model[0], torch.nn.Linear)


@pytest.mark.parametrize("mode", ["w4a8", "w4a8-auto"])
def test_w4a8_model_is_fused_cached_and_the_engine_stays_greedy_exact(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target_dir, draft_dir = write_tiny_pair(tmp_path)
    first = load_model(target_dir, torch.float32, quant=mode)
    assert len(list((tmp_path / "cache" / "quantized").glob("*.safetensors"))) == 1
    second = load_model(target_dir, torch.float32, quant=mode)
    layer = second.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QLinear) and isinstance(layer.mlp.gate_up_proj, QLinear)
    assert set(layer.mlp.down_proj.tile_bits.tolist()) == ({4} if mode == "w4a8" else {8})  # random: off grid
    assert torch.equal(prompt_logits(first, IDS), prompt_logits(second, IDS))
    if mode == "w4a8-auto":  # int8 tiles on these random weights: close to the float model
        dense = prompt_logits(load_model(target_dir, torch.float32), IDS)
        assert ((prompt_logits(second, IDS) - dense).norm() / dense.norm()) < 0.05

    speculative, plain = speculative_and_plain_greedy(second, load_model(draft_dir, torch.float32, quant="w4a8"))
    assert speculative == plain


def test_without_the_kernel_w4a8_says_why_and_defaults_fall_back(monkeypatch):
    monkeypatch.setenv("SPECDEC_NO_KERNELS", "1")
    assert "SPECDEC_NO_KERNELS" in qgemm.unavailable_reason()
    config = resolve_config(EngineConfig(dtype="bfloat16", device="cpu"))
    assert (config.target_quant, config.draft_quant) == ("w8a8", "int4+w8a8")
    monkeypatch.setattr(qgemm, "load_qgemm", lambda: None)
    with pytest.raises(qgemm.KernelUnavailableError, match="SPECDEC_NO_KERNELS=1.*w8a8"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 32)), "w4a8", progress=False)


def test_kernel_defaults_where_it_runs(monkeypatch):
    """The target reads its GGUF as stored, and so does a GGUF draft (the embedded one or a .gguf
    file) at every level; a draft that is no GGUF is re-quantized to int4."""
    from tests.conftest import MACHINE_LEVELS

    monkeypatch.delenv("SPECDEC_NO_KERNELS", raising=False)
    for level in MACHINE_LEVELS:
        monkeypatch.setenv("SPECDEC_ISA", level)
        config = resolve_config(EngineConfig(dtype="bfloat16", device="cpu"))
        assert (config.target_quant, config.draft_quant) == ("gguf", "gguf"), level
        assert resolve_config(EngineConfig(dtype="float32", device="cpu")).target_quant == "none"
        # no draft model at all (a model-free proposer, or none): its quantization is the default's
        config = resolve_config(EngineConfig(draft=None, proposer="ngram", dtype="bfloat16", device="cpu"))
        assert (config.target_quant, config.draft_quant) == ("gguf", "w4a8")
        assert draft_default("/models/Qwen2.5-0.5B-Instruct-Q5_0.GGUF") == "gguf"
        assert draft_default("/models/qwen2.5-0.5b-instruct") == "w4a8"  # safetensors: int4


def _tiny_bf16_pair(tmp_path):
    """A bf16 w4a8 (target, draft) whose head_dim (32) the C attention takes."""
    from specdec.testing import tiny_hf_model

    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        tiny_hf_model("qwen2", seed, num_hidden_layers=layers, **shape).save_pretrained(tmp_path / name)
    return tuple(load_model(tmp_path / n, torch.bfloat16, quant="w4a8") for n in ("target", "draft"))


def test_bf16_engine_on_the_c_decode_path_is_greedy_exact(tmp_path, monkeypatch, simd_level):
    """bf16 end to end on the C kernels (the layer loop of decoder.c: qgemm with its fusions,
    rope + KV write + attention): every row is computed independently of the batch, so k+1-row
    verification agrees exactly with one-row decoding and speculative greedy output equals plain
    greedy output. (On the SDPA reference path the same case differs in 12 tokens.)"""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target, draft = _tiny_bf16_pair(tmp_path)
    runs = []
    real = NativeDecoderStack.run
    monkeypatch.setattr(NativeDecoderStack, "run", lambda *a: runs.append(real(*a)) or runs[-1])
    speculative, plain = speculative_and_plain_greedy(target, draft, dtype="bfloat16")
    assert runs and all(runs), "the C layer loop did not run"
    assert speculative == plain


def test_c_layer_loop_is_bitwise_the_python_layer_loop(tmp_path, monkeypatch, simd_level):
    from specdec.target.runner import ModelRunner, Window

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target, _ = _tiny_bf16_pair(tmp_path)

    def steps(native: bool):
        runner = ModelRunner.build(target, 4, None, num_blocks=32)
        assert target._layer_stack is not None
        if not native:
            target._layer_stack = None
        a, b = runner.new_table(), runner.new_table()
        a.ensure_slots(30), b.ensure_slots(30)
        out = [runner.forward([Window(a, list(range(3, 20)), 1)])]  # prefill
        out.append(runner.forward([Window(b, list(range(40, 49)), 1), Window(a, [7], 1)]))  # prefill + decode
        out.append(runner.forward([Window(a, [8, 9, 10, 11, 12], 5), Window(b, [50, 51], 2)]))  # verify
        return out

    for native, python in zip(steps(True), steps(False)):
        assert torch.equal(native, python)
    import copy

    target.use_layer_stack(NativeDecoderStack.build(target))  # steps(False) dropped it
    assert target._layer_stack is not None
    twin = copy.deepcopy(target)
    assert twin._layer_stack is None  # a copy's buffers are elsewhere
    ids = list(range(3, 20))
    assert torch.equal(prompt_logits(twin, ids), prompt_logits(target, ids))
    target.float()  # .to() and friends replace buffers: the snapshot must go with them
    assert target._layer_stack is None
