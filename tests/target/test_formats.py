"""The format registry: every mode converts, fuses and round-trips through a cache file bitwise."""

import inspect
from pathlib import Path

import pytest
import torch

from specdec.target.quant import qlinear
from specdec.target.quant.cache_file import LAYOUT_SOURCES, layout_key, load_quantized, save_quantized
from specdec.target.quant.convert import prepare_quantized, quantize_model
from specdec.target.quant.formats import FORMATS, MODES, linear_kind
from specdec.target.quant.modes import QUANT_MODES
from specdec.testing import from_hf, tiny_hf_model


@pytest.fixture
def no_kernel_calls(monkeypatch):
    """`QLinear` converts, fuses and stores without its kernel; only `forward` needs it."""
    monkeypatch.setattr(qlinear, "require_qgemm", lambda: None)
    monkeypatch.setattr("specdec.target.quant.convert.require_qgemm", lambda: None)


def _model():
    # head_dim 64: q, k and v each fill whole int4 packing blocks, so every format fuses
    return from_hf(tiny_hf_model("qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1))


def test_every_mode_but_none_has_a_format():
    assert sorted(MODES) == sorted(m for m in QUANT_MODES if m != "none")
    assert {m.format.name for m in MODES.values()} == set(FORMATS)


CONVERTING = [m for m in QUANT_MODES if m not in ("none", "auto")]  # "auto" leaves random weights dense


@pytest.mark.parametrize("mode", CONVERTING)
def test_a_cache_file_gives_back_every_tensor_bitwise(tmp_path, no_kernel_calls, mode):
    model = _model()
    counts = quantize_model(model, mode, progress=False)
    assert counts[MODES[mode].format.name] > 0
    save_quantized(model, tmp_path / "q.safetensors")
    loaded = load_quantized(_model(), tmp_path / "q.safetensors")
    kinds = {n: linear_kind(m) for n, m in model.named_modules()}
    assert {n: linear_kind(m) for n, m in loaded.named_modules()} == kinds
    state, again = model.state_dict(), loaded.state_dict()
    assert set(state) == set(again)
    for key, tensor in again.items():
        assert torch.equal(tensor, state[key]), key


@pytest.mark.parametrize("mode", CONVERTING)
def test_prepare_fuses_qkv_and_gate_up_in_every_format(no_kernel_calls, mode):
    model = _model()
    quantize_model(model, mode, progress=False)
    prepare_quantized(model)
    layer = model.model.layers[0]
    fmt = MODES[mode].format
    assert isinstance(layer.self_attn.qkv_proj, fmt.module) and layer.self_attn.q_proj is None
    assert isinstance(layer.mlp.gate_up_proj, fmt.module) and layer.mlp.up_proj is None


def test_the_cache_key_follows_the_sources_of_the_layout(tmp_path):
    """No hand-bumped version: editing a packer makes a new key, so the kernel never reads a
    file laid out by older code."""
    for fmt in FORMATS.values():
        assert Path(inspect.getfile(fmt.module)) in LAYOUT_SOURCES
    assert all(path.is_file() for path in LAYOUT_SOURCES)
    source = tmp_path / "pack.py"
    source.write_text("TILE = 16\n")
    before = layout_key((source,))
    source.write_text("TILE = 32\n")
    layout_key.cache_clear()
    assert layout_key((source,)) != before
