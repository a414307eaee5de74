"""`NativeDecoderStack` hands `decoder_layers` typed descriptors (`struct specdec_layer` per layer,
`struct specdec_attention` per step) and checks every buffer they point to first (`ValueError`
naming it). Runs without the kernel: a stand-in library records the call."""

import ctypes

import pytest
import torch

from specdec.cache import BlockPool, BlockTable, KVCacheSpec, PagedKVCache, build_attention_metadata, cpu_attention
from specdec.kernel_abi import Attention, Status
from specdec.target.quant import qlinear
from specdec.target.quant.convert import prepare_quantized, quantize_model
from specdec.target.quant.decoder_stack import NativeDecoderStack
from specdec.testing import from_hf, tiny_hf_model


class FakeLibrary:
    """Records what `decoder_layers` receives and returns `status`."""

    def __init__(self, status: int = Status.OK) -> None:
        self.status, self.calls = status, []

    def decoder_layers(self, h, num_rows, layers, num_layers, norm_bf16, eps, a, kv, *rest) -> int:
        attention = Attention.from_buffer_copy(ctypes.cast(a, ctypes.POINTER(Attention)).contents)
        self.calls.append(dict(h=h, num_rows=num_rows, layers=layers, num_layers=num_layers, a=attention, kv=kv))
        return self.status


@pytest.fixture
def model(monkeypatch):
    """A tiny w4a8 model (fp32 norms), converted and fused without the kernel."""
    monkeypatch.setattr(qlinear, "require_qgemm", lambda: None)
    monkeypatch.setattr("specdec.target.quant.convert.require_qgemm", lambda: None)
    monkeypatch.setattr(cpu_attention, "load_attention", lambda: object())  # `supports` asks for it
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    model = from_hf(tiny_hf_model("qwen2", num_hidden_layers=2, **shape))
    quantize_model(model, "w4a8", progress=False)
    prepare_quantized(model)
    return model


def _step(model, positions_dtype=torch.int64):
    """(h [T, 128] bf16, rotation, kv_cache, meta) of one sequence's 3-token window."""
    pool = BlockPool(8)
    table = BlockTable(pool, 4)
    table.ensure_slots(7)
    meta = build_attention_metadata([table], [4], [7], "cpu")
    cache = PagedKVCache(KVCacheSpec(2, 2, 32, 4, torch.bfloat16), pool.num_blocks)
    rotation = model.rotary(torch.arange(4, 7, dtype=positions_dtype), torch.bfloat16)
    return torch.randn(3, 128).bfloat16(), rotation, cache, meta


def test_the_layer_table_is_typed_and_points_at_the_layers_buffers(model):
    stack = NativeDecoderStack(model, FakeLibrary())
    for row, layer in zip(stack.table, model.model.layers):
        qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
        assert (row.qkv.tiles, row.qkv.in_features, row.qkv.out_features) == (qkv.tiles.data_ptr(), 128, 256)
        assert (row.down.tile_offsets, row.down.in_features) == (down.tile_offsets.data_ptr(), 256)
        assert row.input_norm == layer.input_layernorm.weight.data_ptr()
        assert row.qkv.bias == qkv.bias.data_ptr() and row.o.bias is None  # qwen2: q/k/v biases only


def test_a_step_passes_its_descriptor(model):
    lib = FakeLibrary()
    stack = NativeDecoderStack(model, lib)
    h, rotation, cache, meta = _step(model)
    assert stack.run(h, rotation, cache, meta)
    (call,) = lib.calls
    assert (call["h"], call["num_rows"], call["num_layers"], call["kv"]) == (h.data_ptr(), 3, 2, cache.kv.data_ptr())
    assert call["layers"] is stack.table
    a = call["a"]
    assert (a.hq, a.hkv, a.d, a.num_seqs, a.positions) == (4, 2, 32, 1, rotation.positions.data_ptr())


def test_malformed_buffers_are_value_errors_naming_them(model):
    stack = NativeDecoderStack(model, FakeLibrary())
    h, rotation, cache, meta = _step(model)
    with pytest.raises(ValueError, match=r"h must have shape \[3, 128\]"):
        stack.run(torch.randn(3, 96).bfloat16(), rotation, cache, meta)
    with pytest.raises(ValueError, match="positions must be torch.int64"):
        stack.run(h, _step(model, torch.int32)[1], cache, meta)
    assert not stack.run(h.float(), rotation, cache, meta)  # not bf16: the Python loop runs instead
    model.model.layers[1].post_attention_layernorm.weight = torch.nn.Parameter(torch.ones(256)[::2], False)
    with pytest.raises(ValueError, match="post_attention_layernorm.weight must be contiguous"):
        NativeDecoderStack(model, FakeLibrary())


def test_the_kernels_status_becomes_its_exception(model):
    stack = NativeDecoderStack(model, FakeLibrary(Status.ERR_NO_MEMORY))
    with pytest.raises(MemoryError, match="^decoder_layers: "):
        stack.run(*_step(model))
