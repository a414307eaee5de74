"""Weight-only int4 linears: near exact on 4-bit-grid weights, auto leaves the rest dense, cached."""

import math
import types

import pytest
import torch

from specdec.target import model_weights
from specdec.target.quant import cache_file
from specdec.target.quant.convert import prepare_quantized, quantize_model
from specdec.target.quant.int4 import INT8_MIN_ROWS, Int4Linear, fuse_int4, int4_error, quantize_int4
from specdec.target.model_weights import load_model
from specdec.testing import tiny_hf_model


def grid_weights(n: int, k: int, group: int = 32, seed: int = 0) -> torch.Tensor:
    """Weights laid out like dequantized GGUF Q4_K: q * scale - min per group, q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // group, group), generator=g).float()
    scale = torch.rand(n, k // group, 1, generator=g) * 0.02 + 0.001
    offset = torch.rand(n, k // group, 1, generator=g) * 0.1
    return (q * scale - offset).view(n, k)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_int4_is_near_exact_on_grid_weights():
    w = grid_weights(64, 256)
    q, sz = quantize_int4(w, 32)
    assert int4_error(w, q, sz) < 5e-3  # only the bf16 rounding of scales and zeros remains
    x = torch.randn(5, 256)
    assert _rel(Int4Linear.from_quantized(q, sz, None)(x), x @ w.T) < 1e-2


def test_int4_grid_detection_survives_missing_levels():
    w = grid_weights(32, 128).view(32, 4, 32)
    w = torch.where(w > w.mean(-1, keepdim=True), w, w.amin(-1, keepdim=True))  # gaps in the grid
    w = w.reshape(32, 128)
    q, sz = quantize_int4(w, 32)
    assert int4_error(w, q, sz) < 5e-3


def test_a_bounded_quantization_decides_as_the_whole_tensor_error_does(monkeypatch):
    """`quantize_int4(w, g, max_error)` keeps exactly the int4 weights whose `int4_error` is under
    `max_error` (the error summed chunk by chunk), and gives up on the rest before their end."""
    from specdec.target.quant import int4

    grid = grid_weights(96, 256)
    off_grid = torch.randn(96, 256)
    for w in (grid, off_grid, torch.cat([grid[:48], off_grid[:48]])):
        q, sz = quantize_int4(w, 32)
        error = int4_error(w, q, sz)
        for bound in (error * 1.001, error * 0.999, 0.02):
            bounded = quantize_int4(w, 32, bound)
            if error < bound:
                assert bounded is not None and torch.equal(bounded[0], q) and torch.equal(bounded[1], sz)
            else:
                assert bounded is None, (error, bound)
    chunks = []
    for name in ("_quantize_int4_rows", "_quantize_int4_rows_c"):  # the torch path, the C one
        real = getattr(int4, name)
        monkeypatch.setattr(int4, name, lambda *a, real=real: chunks.append(1) or real(*a))
    # 16 chunks of ~1M weights (4 rows of 2^18); noise is ~8% off: over 2% of the whole by the 2nd
    assert quantize_int4(torch.randn(64, 1 << 18), 32, 0.02) is None and len(chunks) == 2


def _quantizer_cases() -> list[torch.Tensor]:
    """Grid weights, noise, both, few-level, constant and zero groups, half-way levels, tiny and
    huge magnitudes, bf16, a group count that is no multiple of 8 (the C quantizer's tail)."""
    g = torch.Generator().manual_seed(5)
    grid = grid_weights(64, 512, seed=1)
    few = grid.clone().view(64, 16, 32)
    few[:, :, 3:] = few[:, :, :1]  # three distinct values per group
    halves = (torch.randint(0, 30, (32, 256), generator=g).float() / 2) * 0.01  # levels k / 2
    return [grid, torch.randn(64, 512, generator=g), torch.cat([grid[:32], torch.randn(32, 512, generator=g)]),
            few.view(64, 512), halves, torch.full((16, 64), 0.25), torch.zeros(16, 64), grid * 1e-9, grid * 1e5,
            torch.randn(32, 128, generator=g).bfloat16(), grid_weights(7, 96, seed=2)]


@pytest.mark.parametrize("bound", [math.inf, 0.02, 0.3])
def test_the_c_quantizer_is_bitwise_the_torch_path(monkeypatch, bound):
    """`int4_quant.c` writes the same q, steps and zeros as `_quantize_int4_rows` and takes the
    same int4-or-not decisions (the quantized cache files of the real pair are `cmp`-identical)."""
    from specdec.target.quant import int4

    if int4.QUANTIZER.load() is None:
        pytest.skip(f"the C quantizer cannot run here: {int4.QUANTIZER.unavailable_reason()}")
    for w in _quantizer_cases():
        c = quantize_int4(w, 32, bound)
        with monkeypatch.context() as mp:
            mp.setattr(int4, "QUANTIZER", types.SimpleNamespace(load=lambda: None))
            reference = quantize_int4(w, 32, bound)
        assert (c is None) == (reference is None), (tuple(w.shape), bound)
        if c is not None:
            assert torch.equal(c[0], reference[0]) and torch.equal(c[1], reference[1]), tuple(w.shape)


def test_auto_picks_int4_for_grid_and_leaves_the_rest_dense():
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(grid_weights(64, 256))
    model.parameters = lambda: iter([torch.zeros(1)])  # CPU check only
    counts = quantize_model(model, "auto")
    assert isinstance(model[0], Int4Linear) and isinstance(model[1], torch.nn.Linear)
    assert counts == {"int4": 1, "int8": 0, "qlinear": 0, "dense": 1}


def test_bad_mode_is_a_value_error():
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(torch.nn.Linear(4, 4), "int3")


@pytest.mark.parametrize("mode", ["int4", "auto", "int4+w8a8"])
def test_quantized_model_is_cached_and_reloads_identically(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "m")
    first = load_model(tmp_path / "m", torch.bfloat16, quant=mode)
    files = list((tmp_path / "cache" / "quantized").glob("*.safetensors"))
    assert len(files) == 1
    second = load_model(tmp_path / "m", torch.bfloat16, quant=mode)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])  # 8 rows: the int8 copy's path in int4+w8a8
    h1 = first.lm_head(first.model.embed_tokens(ids))
    h2 = second.lm_head(second.model.embed_tokens(ids))
    assert torch.equal(h1, h2)
    for name in ("up_proj", "gate_up_proj"):
        assert type(getattr(second.model.layers[0].mlp, name)) is type(getattr(first.model.layers[0].mlp, name))


def test_a_rebuilt_cache_file_replaces_the_stale_one(tmp_path, monkeypatch):
    """A layout change (or new weights) writes a new file; the one it replaces must not stay behind,
    while other modes' and dtypes' files do."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "m")
    load_model(tmp_path / "m", torch.bfloat16, quant="int4")
    load_model(tmp_path / "m", torch.float32, quant="int4")
    load_model(tmp_path / "m", torch.bfloat16, quant="auto")
    folder = tmp_path / "cache" / "quantized"
    before = {p.name for p in folder.glob("*.safetensors")}
    assert len(before) == 3
    monkeypatch.setattr(cache_file, "layout_key", lambda: "a-new-layout")
    load_model(tmp_path / "m", torch.bfloat16, quant="int4")
    after = {p.name for p in folder.glob("*.safetensors")}
    assert len(after) == 3 and len(after - before) == 1
    (gone,) = before - after
    assert "-int4-bfloat16-" in gone
    legacy = folder / "m-int4-0123456789abcdef.safetensors"  # named before the dtype was in names
    legacy.write_bytes(b"")
    assert cache_file.stale_siblings(folder / next(n for n in after if "-int4-bfloat16-" in n)) == [legacy]


def test_auto_finds_the_grid_when_loading_in_bfloat16(tmp_path, monkeypatch):
    """Quantization must see the fp32 weights: a bf16 copy is off the 4-bit grid."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("qwen2")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(grid_weights(*p.shape, seed=len(name)))
    hf.save_pretrained(tmp_path / "m")
    for _ in range(2):  # cold (quantize + cache), then warm (from the cache)
        model = load_model(tmp_path / "m", torch.bfloat16, quant="auto")
        linears = [m for m in model.modules() if isinstance(m, (Int4Linear, torch.nn.Linear))]
        assert all(isinstance(m, Int4Linear) for m in linears)
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_constant_groups_stay_finite():
    """A group whose 32 weights are all equal has no grid step; it must not become inf."""
    w = grid_weights(32, 128)
    w[3, :32] = 0.25
    w[7, 64:96] = 0.0
    q, sz = quantize_int4(w, 32)
    assert torch.isfinite(sz.float()).all()
    x = torch.randn(4, 128)
    out = Int4Linear.from_quantized(q, sz, None)(x)
    assert torch.isfinite(out).all() and _rel(out, x @ w.T) < 1e-2


def _int4(out_features: int, in_features: int, bias: bool, seed: int, int8: bool = False) -> Int4Linear:
    torch.manual_seed(seed)
    w = torch.randn(out_features, in_features)
    q, sz = quantize_int4(w, 32)
    return Int4Linear.from_quantized(q, sz, torch.randn(out_features) if bias else None, w if int8 else None)


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("int8", [False, True])
def test_fused_int4_equals_its_parts_bitwise(rows, int8):
    parts = [_int4(128, 128, True, 0, int8), _int4(64, 128, False, 1, int8), _int4(64, 128, True, 2, int8)]
    fused = fuse_int4(parts)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_int4_with_an_int8_copy_takes_int8_for_long_windows_only():
    """One row (decoding) stays on the int4 kernel; 5+ rows use the int8 copy, close to float."""
    torch.manual_seed(0)
    w, bias = torch.randn(192, 256), torch.randn(192)
    q, sz = quantize_int4(w, 32)
    plain = Int4Linear.from_quantized(q, sz, bias)
    both = Int4Linear.from_quantized(q, sz, bias, int8_from=w)
    x = torch.randn(INT8_MIN_ROWS, 256, dtype=torch.bfloat16)
    assert torch.equal(both(x[:1]), plain(x[:1]))
    assert not torch.equal(both(x), plain(x))
    ref = x.float() @ w.T + bias
    rel = ((both(x).float() - ref).norm() / ref.norm()).item()
    assert rel < 0.02


def test_int4_parts_off_the_packing_blocks_are_not_fused():
    assert fuse_int4([_int4(96, 128, False, 0), _int4(32, 128, False, 1)]) is None
    assert fuse_int4([_int4(64, 128, False, 0), torch.nn.Linear(128, 64)]) is None


def test_int4_model_is_fused_at_load_with_unchanged_logits(tmp_path, monkeypatch):
    """q/k/v and gate/up of an int4 model become one GEMM each; the logits do not move."""
    from specdec.target.runner import ModelRunner, Window

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    # head_dim 64: q, k and v each fill whole packing blocks
    tiny_hf_model("qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1).save_pretrained(
        tmp_path / "m"
    )
    fused = load_model(tmp_path / "m", torch.bfloat16, quant="int4")
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and layer.self_attn.q_proj is None
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear) and layer.mlp.up_proj is None

    monkeypatch.setattr(model_weights, "prepare_quantized", lambda model: None)
    separate = load_model(tmp_path / "m", torch.bfloat16, quant="int4")
    assert separate.model.layers[0].self_attn.qkv_proj is None

    def logits(model):
        runner = ModelRunner.build(model, 4, None, num_blocks=16)
        table = runner.new_table()
        table.ensure_slots(9)
        return runner.forward([Window(table, list(range(3, 12)), 9)])

    assert torch.equal(logits(fused), logits(separate))


def test_a_model_off_the_cpu_is_refused_before_quantizing():
    """The quantized kernels are CPU only: a model elsewhere (CUDA; here the meta device) is a
    clear error, not a crash inside a kernel."""
    from specdec.target.quant.convert import quantize_model

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match="CPU only"):
        quantize_model(model, "int4", progress=False)
