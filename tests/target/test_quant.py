"""Weight-only int4 linears: near exact on 4-bit-grid weights, auto leaves the rest dense, cached."""

import pytest
import torch

from specdec.target.quant import Int4Linear, int4_error, quantize_int4, quantize_model
from specdec.target.weights import load_model
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


def test_auto_picks_int4_for_grid_and_leaves_the_rest_dense():
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(grid_weights(64, 256))
    model.parameters = lambda: iter([torch.zeros(1)])  # CPU check only
    counts = quantize_model(model, "auto")
    assert isinstance(model[0], Int4Linear) and isinstance(model[1], torch.nn.Linear)
    assert counts == {"int4": 1, "int8": 0, "dense": 1}


def test_bad_mode_is_a_value_error():
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(torch.nn.Linear(4, 4), "int3")


@pytest.mark.parametrize("mode", ["int4", "auto"])
def test_quantized_model_is_cached_and_reloads_identically(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "m")
    first = load_model(tmp_path / "m", torch.bfloat16, quant=mode)
    files = list((tmp_path / "cache" / "quantized").glob("*.safetensors"))
    assert len(files) == 1
    second = load_model(tmp_path / "m", torch.bfloat16, quant=mode)
    ids = torch.tensor([[3, 4, 5, 6]])
    h1 = first.lm_head(first.model.embed_tokens(ids))
    h2 = second.lm_head(second.model.embed_tokens(ids))
    assert torch.equal(h1, h2)
    assert type(second.model.layers[0].mlp.up_proj) is type(first.model.layers[0].mlp.up_proj)


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
