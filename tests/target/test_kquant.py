"""GGUF Q4_K / Q6_K tiles (`kquant.py`, `kquant_tiles.h`): the file's weights exactly, what the
kernel computes with them, batch invariance, fusion with the other formats, refusals, and the
"gguf" loading mode that takes them from the mapped file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from specdec.kernel_abi import (TILE_BF16, TILE_F16, TILE_IQ4_NL, TILE_IQ4_XS, TILE_MXFP4, TILE_Q2_K, TILE_Q3_K, TILE_Q4_0,
                                TILE_Q4_1, TILE_Q4_K, TILE_Q5_0, TILE_Q5_K, TILE_Q6_K, TILE_Q8_0)
from specdec.target.quant import kquant, qgemm
from specdec.target.quant.qlinear import QLinear, dequantize, fuse_qlinear, reference_qgemm

pytestmark = pytest.mark.skipif(
    qgemm.unavailable_reason() is not None, reason=f"w4a8 kernel unavailable: {qgemm.unavailable_reason()}"
)
KINDS = {TILE_Q4_K: T.Q4_K, TILE_Q5_K: T.Q5_K, TILE_Q6_K: T.Q6_K, TILE_Q5_0: T.Q5_0, TILE_Q4_0: T.Q4_0,
         TILE_Q4_1: T.Q4_1, TILE_IQ4_NL: T.IQ4_NL, TILE_MXFP4: T.MXFP4,
         TILE_IQ4_XS: T.IQ4_XS, TILE_Q3_K: T.Q3_K, TILE_Q2_K: T.Q2_K, TILE_Q8_0: T.Q8_0, TILE_F16: T.F16,
         TILE_BF16: T.BF16}
BLOCK_KINDS = [kind for kind in KINDS if kind not in kquant.FLOAT_KINDS]  # integer codes: their sums can overflow


def k_blocks(kind: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks `[rows, cols / inputs per block * block bytes]`: every quant code and
    sub-scale (Q8_0's -128 included), fp16 scales spread over four decades (gguf cannot quantize
    to k-quants). F16 / BF16: values over eight decades of either sign (F16's subnormals among
    them) and zeros, as bytes."""
    rng = np.random.default_rng(seed)
    if kind in kquant.FLOAT_KINDS:
        values = rng.choice([-1, 1], (rows, cols)) * 10.0 ** rng.uniform(-7, 1, (rows, cols))
        values[rng.random((rows, cols)) < 0.05] = 0.0
        stored = values.astype(np.float16) if kind == TILE_F16 else gguf.quants.quantize(values.astype(np.float32), T.BF16)
        return stored.view(np.uint8).reshape(rows, -1)
    count = cols // kquant.BLOCK_INPUTS[kind]
    blocks = rng.integers(0, 256, (rows, count, kquant.BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (10.0 ** rng.uniform(-5, -1, (rows, count, 2))).astype(np.float16)
    scales[..., 1] *= rng.choice([-1, 1], (rows, count))  # Q4_1's m takes either sign
    scales = scales.view(np.uint8)
    if kind in (TILE_Q4_K, TILE_Q5_K, TILE_Q4_1):  # d, dmin (fp16), scales[12], (qh[32]), qs; Q4_1: d, m, qs[16]
        blocks[..., 0:4] = scales.reshape(rows, count, 4)
    elif kind == TILE_Q6_K:  # ql[128], qh[64], scales[16] int8, d (fp16)
        blocks[..., 208:210] = scales[..., :2]
    elif kind == TILE_Q3_K:  # hmask[32], qs[64], scales[12], d
        blocks[..., 108:110] = scales[..., :2]
    elif kind == TILE_Q2_K:  # scales[16], qs[64], d, dmin
        blocks[..., 80:84] = scales.reshape(rows, count, 4)
    elif kind == TILE_MXFP4:  # e (2^(e - 128)), qs[16]: exponents around 2^-8, and 0 and 1 (subnormal)
        blocks[..., 0] = rng.choice(np.array([0, 1, 2, 100, 110, 118, 120, 125, 127], dtype=np.uint8), (rows, count))
    else:  # Q5_0: d (fp16), qh[4], qs[16]; Q4_0, IQ4_NL: d, qs[16]; Q8_0: d (fp16), qs[32] int8
        blocks[..., 0:2] = scales[..., :2]
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_tiles_hold_exactly_the_files_weights_in_the_files_bytes(kind):
    raw = k_blocks(kind, 48, 768)
    q = QLinear.from_gguf(raw, kind, 768, None)
    assert q.tiles.numel() == raw.nbytes  # 4.5 / 5.5 / 6.5625 / 5.5 / 4.5 / 5 / 4.5 / 4.25 / 4.25 / 3.4375 / 2.625 / 8.5 / 16 bits a weight, as the file
    expected = torch.from_numpy(gguf.quants.dequantize(raw, KINDS[kind]))
    assert torch.equal(dequantize(q), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_the_c_packer_gives_the_torch_packers_bytes(kind):
    raw = k_blocks(kind, 64, 512, seed=3)
    assert kquant.PACKER.load() is not None
    assert torch.equal(kquant.pack_kquant(raw, kind), kquant.pack_kquant_torch(raw, kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13])
def test_kernel_computes_the_product_with_its_activations(kind, dtype, rows, simd_level):
    """Activations per 256 inputs for Q4_K / Q6_K, per 32 for Q5_0 / Q8_0 (`reference_qgemm`)."""
    g = torch.Generator().manual_seed(rows)
    q = QLinear.from_gguf(k_blocks(kind, 32, 512, seed=1), kind, 512, torch.randn(32, generator=g))
    x = (torch.randn(rows, 512, generator=g) * 3).to(dtype)
    y, ref = q(x).float(), reference_qgemm(x.float(), q)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((y - ref).norm() / ref.norm()) < tol
    assert torch.equal(q(x), torch.cat([q(x[i : i + 1]) for i in range(rows)]))  # batch invariant


@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("rows", [1, 4, 13])
def test_the_largest_quants_and_activations_do_not_overflow_the_integer_sums(kind, rows, simd_level):
    """Every quant at its largest code and every activation +127 (the worst case of the int16 pair
    sums, which random blocks never reach): the kernel still gives the product, at every level,
    in the register passes and, at 13 rows, the decoded-once ones."""
    raw = k_blocks(kind, 16, 512, seed=2)
    blocks = raw.reshape(16, -1, kquant.BLOCK_BYTES[kind])
    keep = {TILE_Q4_K: slice(0, 4), TILE_Q5_K: slice(0, 4), TILE_Q4_1: slice(0, 4), TILE_Q6_K: slice(208, 210),
            TILE_MXFP4: slice(0, 1), TILE_Q3_K: slice(108, 110), TILE_Q2_K: slice(80, 84)}
    scales = blocks[..., keep.get(kind, slice(0, 2))].copy()
    blocks[...] = 0xFF
    if kind == TILE_Q6_K:  # sub-scales 127 and quants 63: w = d * 127 * 31
        blocks[..., 192:208] = 127
    if kind == TILE_Q8_0:  # the codes -128..127 as int8: -128 is the largest product
        blocks[..., 2:] = 0x80
    if kind in (TILE_IQ4_NL, TILE_MXFP4):  # each table's largest value: -127 (code 0), 12 (code 7)
        blocks[..., 2 if kind == TILE_IQ4_NL else 1 :] = 0x00 if kind == TILE_IQ4_NL else 0x77
    if kind == TILE_IQ4_XS:  # ls 63 (w = d * 31 * -127)
        blocks[..., 8:] = 0x00
    blocks[..., keep.get(kind, slice(0, 2))] = scales
    if kind in (TILE_Q4_K, TILE_Q5_K):  # no min: every weight d * 63 * q
        blocks[..., 2:4] = 0
    q = QLinear.from_gguf(blocks.reshape(16, -1), kind, 512, None)
    x = torch.ones(rows, 512)
    y, ref = q(x), reference_qgemm(x, q)
    assert ((y - ref).norm() / ref.norm()) < 1e-5


def test_fused_epilogues_and_mixed_formats_match_their_parts(simd_level):
    """GGUF tiles beside int4 / int8 tiles in one fused linear (Q4_K_M's q/k/v: Q4_K, Q4_K, Q6_K;
    the draft's: Q5_0, and Q8_0 where a tensor is): each part's outputs bitwise what it gives alone,
    with the norm, GLU and residual fused."""
    g = torch.Generator().manual_seed(7)
    parts = [QLinear.from_gguf(k_blocks(TILE_Q4_K, 32, 256, seed=4), TILE_Q4_K, 256, None),
             QLinear.from_gguf(k_blocks(TILE_Q6_K, 16, 256, seed=5), TILE_Q6_K, 256, torch.randn(16, generator=g)),
             QLinear.from_weight(torch.randn(16, 256, generator=g) * 0.05, None, int4_max_error=0.0),
             QLinear.from_gguf(k_blocks(TILE_Q5_0, 32, 256, seed=6), TILE_Q5_0, 256, None),
             QLinear.from_weight(torch.randn(16, 256, generator=g) * 0.05, None, int4_max_error=1.0),
             QLinear.from_gguf(k_blocks(TILE_Q8_0, 16, 256, seed=8), TILE_Q8_0, 256, torch.randn(16, generator=g))]
    fused = fuse_qlinear(parts)
    assert set(fused.tile_bits.tolist()) == {TILE_Q4_K, TILE_Q6_K, 8, TILE_Q5_0, 4, TILE_Q8_0}
    x, norm = torch.randn(5, 256, generator=g).bfloat16(), (torch.rand(256, generator=g) + 0.5).bfloat16()
    gate_up = torch.randn(5, 512, generator=g).bfloat16()
    residual = torch.randn(5, 128, generator=g).bfloat16()
    for call in (lambda m, r: m(x), lambda m, r: m(gate_up, glu=True),
                 lambda m, r: m(x, norm_weight=norm, eps=1e-6, residual=r)):
        whole = call(fused, residual)
        ends = [0, 32, 48, 64, 96, 112, 128]
        pieces = [call(p, residual[:, a:b]) for p, a, b in zip(parts, ends, ends[1:])]
        assert torch.equal(whole, torch.cat(pieces, -1))


def test_kquant_tiles_off_the_super_block_grid_are_refused():
    raw = k_blocks(TILE_Q4_K, 16, 256)
    with pytest.raises(ValueError, match="in_features % 256"):
        QLinear.from_gguf(raw[:, :144], TILE_Q4_K, 128, None)
    q = QLinear.from_gguf(raw, TILE_Q4_K, 256, None)
    q.tiles = q.tiles[:-1].clone()
    with pytest.raises(ValueError, match="outside tiles"):
        q(torch.randn(1, 256))


def _tiny_gguf(tmp_path, monkeypatch, k_quants_only: bool, types: dict[str, str] | None = None):
    from specdec.target.model_files import resolve_model
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.test_gguf_streaming import _write_qwen2_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen2.gguf"
    _write_qwen2_gguf(path, build_tiny_tokenizer(), tie=False, k_quants_only=k_quants_only, types=types)
    return resolve_model(str(path), progress=False)


def test_gguf_mode_reads_k_quant_tensors_as_stored(tmp_path, monkeypatch):
    """Mode "gguf" on a GGUF of Q4_K / Q6_K / Q8_0 / Q5_0 / F16 tensors: every one becomes tiles
    holding the file's values exactly (the F16 head's 16-bit values too), so no cache file is written."""
    from specdec.target.model_weights import load_model
    from specdec.target.quant.cache_file import quant_cache_path
    from tests.target.test_gguf_streaming import _prompt_inputs

    folder = _tiny_gguf(tmp_path, monkeypatch, k_quants_only=False)
    dense = load_model(folder, torch.float32)
    model = load_model(folder, torch.bfloat16, quant="gguf")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv = getattr(attn, "qkv_proj", None)
    assert qkv is not None and {TILE_Q4_K, TILE_Q6_K} <= set(qkv.tile_bits.tolist())  # q, k Q4_K; v Q6_K
    d = dense.model.layers[1]
    expected = torch.cat([d.self_attn.q_proj.weight, d.self_attn.k_proj.weight, d.self_attn.v_proj.weight])
    assert torch.equal(dequantize(qkv), expected)
    assert torch.equal(dequantize(mlp.down_proj), d.mlp.down_proj.weight)  # Q6_K
    assert set(attn.o_proj.tile_bits.tolist()) == {TILE_Q8_0}
    assert torch.equal(dequantize(attn.o_proj), d.self_attn.o_proj.weight)
    gate_up = getattr(mlp, "gate_up_proj", None)
    assert gate_up is not None and set(gate_up.tile_bits.tolist()) == {TILE_Q5_0, TILE_Q4_K}
    assert torch.equal(dequantize(gate_up), torch.cat([d.mlp.gate_proj.weight, d.mlp.up_proj.weight]))
    assert set(model.lm_head.tile_bits.tolist()) == {TILE_F16}  # the F16 head's values as stored
    assert torch.equal(dequantize(model.lm_head), dense.lm_head.weight)
    assert not quant_cache_path(folder, "gguf", torch.bfloat16).exists()  # nothing re-quantized: no cache
    assert model(*_prompt_inputs(model)).isfinite().all()


def test_k_quant_tensors_read_as_stored_and_a_type_without_a_kernel_is_named(tmp_path, monkeypatch, capsys):
    """A GGUF whose matrices are Q5_K, Q2_K, Q3_K and Q5_1: the first three become tiles holding the
    file's values; the Q5_1 ones (no kernel) are re-quantized, and one line says which type, which
    tensors and how many bytes they take against the file's."""
    from specdec.target.model_weights import load_model
    from tests.target.test_gguf_streaming import _prompt_inputs

    folder = _tiny_gguf(tmp_path, monkeypatch, k_quants_only=False,
                        types={"Q4_K": "Q5_K", "Q8_0": "Q2_K", "Q5_0": "Q5_1", "Q6_K": "Q3_K"})
    dense = load_model(folder, torch.float32)
    capsys.readouterr()
    model = load_model(folder, torch.bfloat16, quant="gguf")
    layer, d = model.model.layers[1], dense.model.layers[1]
    assert set(layer.self_attn.o_proj.tile_bits.tolist()) == {TILE_Q2_K}
    assert torch.equal(dequantize(layer.self_attn.o_proj), d.self_attn.o_proj.weight)
    assert set(layer.mlp.down_proj.tile_bits.tolist()) == {TILE_Q3_K}
    assert torch.equal(dequantize(layer.mlp.down_proj), d.mlp.down_proj.weight)
    qkv = layer.self_attn.qkv_proj
    assert set(qkv.tile_bits.tolist()) == {TILE_Q5_K, TILE_Q3_K}  # q, k Q5_K; v Q3_K
    assert torch.equal(dequantize(qkv), torch.cat([d.self_attn.q_proj.weight, d.self_attn.k_proj.weight,
                                                   d.self_attn.v_proj.weight]))
    gate_up = layer.mlp.gate_up_proj  # gate Q5_1, re-quantized; up Q5_K as stored
    assert TILE_Q5_K in set(gate_up.tile_bits.tolist()) and set(gate_up.tile_bits.tolist()) & {4, 8}
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if " Q5_1 tensors" in x)
    assert "(mlp.gate_proj in 2 layers): no kernel yet" in line and "MB where the file holds" in line
    assert "F16" not in err  # the F16 head is read as stored
    assert model(*_prompt_inputs(model)).isfinite().all()
    load_model(folder, torch.bfloat16, quant="gguf")  # from the cache file: the same notice again
    assert line in capsys.readouterr().err


def test_iq4_xs_iq4_nl_and_mxfp4_tensors_read_as_stored(tmp_path, monkeypatch):
    """A GGUF whose matrices are IQ4_XS (for Q4_K), IQ4_NL (Q5_0), MXFP4 (Q8_0) and Q5_K (Q6_K): every one a
    tile of the file's values, and nothing re-quantized (no cache file)."""
    from specdec.target.model_weights import load_model
    from specdec.target.quant.cache_file import quant_cache_path
    from tests.target.test_gguf_streaming import _prompt_inputs

    folder = _tiny_gguf(tmp_path, monkeypatch, k_quants_only=False,
                        types={"Q4_K": "IQ4_XS", "Q5_0": "IQ4_NL", "Q8_0": "MXFP4", "Q6_K": "Q5_K", "F16": "IQ4_NL"})
    dense = load_model(folder, torch.float32)
    model = load_model(folder, torch.bfloat16, quant="gguf")
    layer, d = model.model.layers[0], dense.model.layers[0]
    assert set(layer.self_attn.o_proj.tile_bits.tolist()) == {TILE_MXFP4}
    assert torch.equal(dequantize(layer.self_attn.o_proj), d.self_attn.o_proj.weight)
    assert set(layer.mlp.gate_up_proj.tile_bits.tolist()) == {TILE_IQ4_NL, TILE_IQ4_XS}
    assert torch.equal(dequantize(layer.mlp.gate_up_proj), torch.cat([d.mlp.gate_proj.weight, d.mlp.up_proj.weight]))
    assert set(model.lm_head.tile_bits.tolist()) == {TILE_IQ4_NL}
    assert not quant_cache_path(folder, "gguf", torch.bfloat16).exists()
    assert model(*_prompt_inputs(model)).isfinite().all()


def test_a_model_wholly_in_k_quants_loads_without_a_cache_and_answers_as_a_cached_one(tmp_path, monkeypatch):
    from specdec.target.model_weights import load_model
    from specdec.target.quant.cache_file import quant_cache_path
    from tests.target.test_gguf_streaming import _prompt_inputs

    folder = _tiny_gguf(tmp_path, monkeypatch, k_quants_only=True)
    first = load_model(folder, torch.bfloat16, quant="gguf")
    assert not quant_cache_path(folder, "gguf", torch.bfloat16).exists()
    again = load_model(folder, torch.bfloat16, quant="gguf")
    inputs = _prompt_inputs(first)
    assert torch.equal(first(*inputs), again(*inputs))


def test_every_level_computes_kquant_tiles_bitwise_the_same(monkeypatch):
    """The GGUF tiles run one 256-bit source at every level (Q8_0: the int8 tiles' per-level
    code; at AVX-512 VNNI 512-bit passes of up to 6 rows with vpdpbusd sums for every k-quant row
    count, Q5_0 packed or decoded): the AVX-512 VNNI, AVX-VNNI and AVX2 builds agree bit for bit
    (1 to 13 rows, each fusion, fp32 and bf16). Compares the levels this machine runs."""
    from tests.conftest import MACHINE_LEVELS

    if len(MACHINE_LEVELS) < 2:
        pytest.skip(f"one level runs here ({MACHINE_LEVELS}): nothing to compare")
    g = torch.Generator().manual_seed(9)
    x, gate_up = torch.randn(13, 512, generator=g), torch.randn(13, 1024, generator=g) * 30
    norm, residual = torch.rand(512, generator=g) + 0.5, torch.randn(13, 32, generator=g)
    results = {}
    for level in MACHINE_LEVELS:
        monkeypatch.setenv("SPECDEC_ISA", level)
        out = []
        for kind in KINDS:
            q = QLinear.from_gguf(k_blocks(kind, 32, 512, seed=kind), kind, 512, None)
            for rows in (1, 2, 3, 4, 5, 6, 13):
                a, b, r = x[:rows].bfloat16(), gate_up[:rows].bfloat16(), residual[:rows].bfloat16()
                out += [q(a), q(b, glu=True), q(a, norm_weight=norm.bfloat16(), eps=1e-6, residual=r),
                        q(x[:rows])]  # fp32 out: bf16 rounding would hide an fp32 step in another order
        results[level] = out
    first = MACHINE_LEVELS[0]
    for level in MACHINE_LEVELS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[first], results[level])), (first, level)


def test_stacked_q4_k_experts_are_read_per_expert_as_stored(tmp_path, monkeypatch):
    """An MoE GGUF with Q4_K stacked experts (llama.cpp's `ffn_*_exps`): in mode "gguf" each
    expert's linears are k-quant tiles of that expert's slice, exactly the file's values."""
    from specdec.target.model_files import resolve_model
    from specdec.target.model_weights import load_model
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.moe_models import moe_hf_model, write_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tiny_tokenizer()
    hf = moe_hf_model("qwen3_moe", vocab_size=len(tokenizer), hidden_size=256, moe_intermediate_size=256)
    path = tmp_path / "tiny-qwen3moe-q4k.gguf"
    write_gguf(hf, path, tokenizer, "Q4_K")
    folder = resolve_model(str(path), progress=False)
    dense, model = load_model(folder, torch.float32), load_model(folder, torch.bfloat16, quant="gguf")
    layer = next(i for i, m in enumerate(model.model.layers) if hasattr(m.mlp, "experts"))
    for e in (0, 5):
        ours, ref = model.model.layers[layer].mlp.experts[e], dense.model.layers[layer].mlp.experts[e]
        assert set(ours.down_proj.tile_bits.tolist()) == {TILE_Q4_K}
        assert torch.equal(dequantize(ours.down_proj), ref.down_proj.weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_an_embedding_lookup_reads_the_files_values_exactly(kind, dtype):
    """`GGUFEmbedding` rows of the four block formats (in C for bf16 / fp32, in torch otherwise):
    gguf's own dequantized values, fp16 scales down to subnormals, rounded to the dtype as torch
    rounds; ids outside the table refused as `nn.Embedding` refuses them."""
    from types import SimpleNamespace

    from specdec.target.gguf_embedding import GGUFEmbedding

    raw = k_blocks(kind, 40, 512, seed=3)
    file = SimpleNamespace(tensors={"t": SimpleNamespace(ggml_type=int(KINDS[kind]), shape=(40, 512))}, raw=lambda name: raw)
    emb = GGUFEmbedding(file, "t", dtype)
    assert emb._c_kind == (None if kind in kquant.FLOAT_KINDS else kind)  # float rows: torch's conversion
    ids = torch.tensor([[0, 39, 5, 5], [17, 2, 0, 38]])
    expected = torch.from_numpy(gguf.quants.dequantize(raw, KINDS[kind])).to(dtype)[ids]
    assert torch.equal(emb(ids), expected)
    assert emb(torch.tensor([], dtype=torch.long)).shape == (0, 512)
    for bad in (40, -1):
        with pytest.raises(IndexError):
            emb(torch.tensor([3, bad]))
