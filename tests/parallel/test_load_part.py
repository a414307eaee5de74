"""A rank of a split target reads its part only (`LoadPart`): a pipeline stage its layers, a
tensor-parallel rank each layer cut as soon as it is read, on every loading path (a GGUF read as
stored, a GGUF with a cache file, a float checkpoint); the part equals the whole model cut after
loading."""

from __future__ import annotations

import pytest
import torch

from specdec.parallel import shard
from specdec.target import quantized_stream
from specdec.target.model_weights import LoadPart, load_model


def gguf_folder(tmp_path, monkeypatch, head: str):
    from specdec.target.model_files import resolve_model
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.test_gguf_streaming import _write_qwen2_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen2.gguf"  # 2 layers of Q4_K, Q6_K, Q8_0 (o_proj), Q5_0 tensors
    _write_qwen2_gguf(path, build_tiny_tokenizer(), tie=False, head=head)
    return resolve_model(str(path), progress=False)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if not k.startswith("rotary.")}


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("head", ["Q8_0", "Q5_1"], ids=["gguf-as-stored", "gguf-cached"])
def test_a_rank_reads_its_part_only(tmp_path, monkeypatch, head):
    folder = gguf_folder(tmp_path, monkeypatch, head)  # a Q5_1 head (no kernel) is re-quantized: a cache file
    whole = load_model(folder, torch.bfloat16, quant="gguf")
    cfg = whole.config

    order = []
    fill = quantized_stream._LayerLoader.fill
    monkeypatch.setattr(quantized_stream._LayerLoader, "fill",
                        lambda self, prefix: (order.append(prefix), fill(self, prefix))[1])
    stage = load_model(folder, torch.bfloat16, quant="gguf", part=shard.load_part("pipeline", cfg, 1, 2, None))
    assert (stage.layer_offset, len(stage.model.layers)) == (1, 1)
    assert_same(stage.model.layers[0], whole.model.layers[1])
    read = [o for o in order if o.startswith("model.layers")]
    assert read == (["model.layers.1"] if head == "Q8_0" else [])  # (cached: the file's tiles, mapped)

    order.clear()
    part = shard.load_part("tensor", cfg, 1, 2, None)
    traced = LoadPart(cut=lambda i, layer: (order.append(f"cut {i}"), part.cut(i, layer))[1])
    rank = load_model(folder, torch.bfloat16, quant="gguf", part=traced)
    assert [o for o in order if o.startswith(("model.layers", "cut"))] == (
        ["model.layers.0", "cut 0", "model.layers.1", "cut 1"] if head == "Q8_0" else ["cut 0", "cut 1"])
    shard.tensor_parallel(rank, 1, 2, None)  # the LM head's vocabulary; the layers are cut already
    shard.tensor_parallel(whole, 1, 2, None)
    assert_same(rank, whole)


def test_a_float_checkpoint_too(tmp_path_factory, pair):
    whole = load_model(pair[0], torch.float32)
    stage = load_model(pair[0], torch.float32, part=LoadPart(layers=range(2, 4)))
    assert (stage.layer_offset, len(stage.model.layers)) == (2, 2)
    assert_same(stage.model.layers[1], whole.model.layers[3])
    rank = load_model(pair[0], torch.float32, part=shard.load_part("tensor", whole.config, 0, 2, None))
    shard.tensor_parallel(rank, 0, 2, None)
    shard.tensor_parallel(whole, 0, 2, None)
    assert_same(rank, whole)
